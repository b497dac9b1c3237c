"""The Python API runs what the commands run: the same recipe, the same checkpoint."""

import pytest
import yaml
from pydantic import ValidationError
from safetensors.torch import load_file
from typer.testing import CliRunner

import attnsurg
from attnsurg import api
from attnsurg.cli import app
from attnsurg.errors import UserError
from attnsurg.methods.mla.settings import MLA_CALIBRATION


def tensors(directory):
    return {name: t for shard in sorted(directory.glob("*.safetensors")) for name, t in load_file(shard).items()}


def calibration(corpus_file) -> dict:
    return {"data": {"text": str(corpus_file)}, "tokens": 512, "seq_len": 64}


def cli_flags(corpus_file) -> list[str]:
    return ["--calib-text", str(corpus_file), "--calib-tokens", "512", "--calib-seq-len", "64", "--eval-tokens", "0"]


@pytest.mark.parametrize("command, settings, flags", [
    ("convert", {"to": "mla", "kv_budget": 0.5, "refine_steps": 2}, ["--to", "mla", "--kv-budget", "0.5", "--refine-steps", "2"]),
    ("compress", {"method": "svdllm", "ratio": 0.5}, ["--method", "svdllm", "--ratio", "0.5"]),
])
def test_a_function_writes_what_its_command_writes(command, settings, flags, tiny_checkpoints, corpus_file, tmp_path):
    model = str(tiny_checkpoints["llama-gqa"])
    report = getattr(attnsurg, command)(model, tmp_path / "api", calibration=calibration(corpus_file), eval_tokens=0,
                                        eval_domains=[], **settings)
    assert report.written == str(tmp_path / "api")
    result = CliRunner().invoke(app, [command, model, *flags, *cli_flags(corpus_file), "--eval-domains", "none",
                                      "-o", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    recipe = {name: yaml.safe_load((tmp_path / name / "attnsurg_recipe.yaml").read_text()) for name in ("api", "cli")}
    assert recipe["api"] | {"output": None} == recipe["cli"] | {"output": None}
    api, cli = tensors(tmp_path / "api"), tensors(tmp_path / "cli")
    assert api.keys() == cli.keys() and all((api[k] == cli[k]).all() for k in api)


def test_the_functions_take_the_commands_defaults():
    """Unset, the calibration is what the command line calibrates on (every built-in domain), not a recipe's."""
    convert = api.surgery_recipe("m", "out", api.ConvertStep(convert={}), None, None, 2048, api.EVAL_DOMAINS, 0)
    assert convert.calibration == MLA_CALIBRATION and convert.calibration.tokens == 6144
    linear = api.surgery_recipe("m", "out", api.ConvertStep(convert={"to": "linear"}), None, None, 2048, api.EVAL_DOMAINS, 0)
    assert linear.calibration.data.dataset == "all" and linear.calibration.tokens == 24576
    compress = api.surgery_recipe("m", "out", api.CompressStep(compress={"method": "svd"}), None, None, 2048,
                                  api.EVAL_DOMAINS, 0)
    assert compress.calibration.data.dataset == "all" and compress.calibration.tokens == 4096


def test_evaluate_scores_every_model_on_the_same_windows(tiny_checkpoints, corpus_file):
    models = [str(tiny_checkpoints["llama-gqa"]), str(tiny_checkpoints["qwen2"])]
    report = attnsurg.evaluate(models, data={"text": str(corpus_file)}, max_length=64, max_tokens=256)
    assert [r.model for r in report.results] == models
    assert report.results[0].ratio == 1.0 and report.results[1].tokens_fingerprint == report.results[0].tokens_fingerprint


def test_bad_arguments_name_what_is_wrong(tiny_checkpoints, tmp_path):
    model = str(tiny_checkpoints["llama-gqa"])
    with pytest.raises(UserError, match="to='gla' is not supported; available: linear, mla"):
        attnsurg.convert(model, tmp_path / "o", to="gla")
    with pytest.raises(ValidationError, match="kv_budget"):
        attnsurg.convert(model, tmp_path / "o", to="linear", kv_budget=0.5)
    with pytest.raises(ValidationError, match="kv_budgett"):
        attnsurg.convert(model, tmp_path / "o", kv_budgett=0.5)
    with pytest.raises(ValidationError, match="unknown_method|compress needs method"):
        attnsurg.compress(model, tmp_path / "o", method="nope")
    with pytest.raises(UserError, match="what='latency'"):
        attnsurg.evaluate(model, "latency")
    assert not (tmp_path / "o").exists()
