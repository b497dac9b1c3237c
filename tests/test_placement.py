"""Where the work runs: --device, and (on a machine with a GPU) CUDA results equal to the CPU's."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import attention_layers, input_statistics
from attnsurg.cli import app
from attnsurg.methods.mla.conversion import convert
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.methods.mla.refine import Refinement
from attnsurg.placement import on_device

from conftest import with_mean_direction

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these)")


def test_on_device_leaves_a_module_where_it_is_when_it_is_there_already():
    module = torch.nn.Linear(3, 2)
    weight = module.weight
    with on_device(module, "cpu") as moved, on_device(module, None):
        assert moved is module and module.weight is weight


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", [["convert"], ["compress", "--method", "svdllm", "--ratio", "0.5"]])
def test_a_gpu_this_machine_lacks_is_one_line_before_any_work(command, tiny_checkpoints, corpus_file, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [*command, str(tiny_checkpoints["llama-gqa"]), "--calib-text", str(corpus_file),
                                      "--device", "cuda", "-o", str(out), "--dry-run"])
    assert result.exit_code == 2 and not out.exists()
    assert "no CUDA GPU" in result.output and "--device cpu" in result.output and "Traceback" not in result.output


def test_device_cpu_is_the_default_result(tiny_checkpoints, corpus_file, tmp_path):
    """--device cpu on any machine writes what the CPU default writes."""
    runner = CliRunner()
    common = ["convert", str(tiny_checkpoints["qwen2"]), "--calib-text", str(corpus_file), "--calib-tokens", "256",
              "--calib-seq-len", "64", "--refine-steps", "2", "--refine-tokens", "128", "--eval-tokens", "0"]
    for name, extra in (("default", []), ("cpu", ["--device", "cpu"])):
        assert runner.invoke(app, [*common, *extra, "-o", str(tmp_path / name)]).exit_code == 0
    first, second = (AutoModelForCausalLM.from_pretrained(tmp_path / n) for n in ("default", "cpu"))
    if torch.cuda.is_available():  # auto picked the GPU for the default
        return
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


@CUDA
def test_statistics_on_cuda_equal_the_cpu_ones(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    family = family_for_surgery("llama")
    windows = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    on_cpu = input_statistics(model, attention_layers(model, family), windows)
    on_gpu = input_statistics(model, attention_layers(model, family), windows, device=torch.device("cuda"))
    assert next(model.parameters()).device.type == "cpu"  # moved back
    for a, b in zip(on_cpu, on_gpu):
        assert b.sigma.device.type == "cpu"
        torch.testing.assert_close(b.sigma, a.sigma, rtol=1e-4, atol=1e-5)


@CUDA
def test_mla_conversion_on_cuda_matches_the_cpu_one(tiny_checkpoints):
    """Calibration and refinement on the GPU, fitting on the CPU: the same model within float32 tolerance."""
    source = with_mean_direction(AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen2"]))
    plan = plan_mla(inspect_config(source.config), kv_budget=0.5)
    windows = torch.randint(0, source.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0))
    refinement = Refinement(5, tokens=4 * 32)
    family = family_for_surgery("qwen2")
    on_cpu = convert(source, family, windows, plan, refinement=refinement).model
    on_gpu = convert(source, family, windows, plan, refinement=refinement, device=torch.device("cuda")).model
    ids = torch.randint(0, source.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(on_gpu.cpu()(ids).logits, on_cpu(ids).logits, rtol=2e-3, atol=2e-3)
