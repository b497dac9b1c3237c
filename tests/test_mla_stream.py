"""The streamed conversion writes what the in-memory one builds, reading one layer at a time."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import short_prompt_starts
from attnsurg.io.lazy import CheckpointReader
from attnsurg.methods.mla.conversion import convert
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.methods.mla.refine import Refinement
from attnsurg.methods.mla.stream import convert_streamed

from conftest import assert_streamed_like_loaded, with_mean_direction


@pytest.mark.parametrize("variant,refine_steps,received,short", [
    ("llama-gqa", 0, False, 0.0), ("qwen2", 5, False, 0.0), ("llama-mha", 5, False, 0.0), ("qwen2", 0, True, 0.0),
    ("llama-gqa", 5, False, 0.5)])
def test_streamed_conversion_equals_the_in_memory_one(variant, refine_steps, received, short, tiny_checkpoints, tmp_path):
    """The same conversion both ways, and with ``short`` the windows' last half cut into short prompts: the loaded
    run passes each prompt alone, the streamed one masks each to itself with its own positions."""
    source = with_mean_direction(AutoModelForCausalLM.from_pretrained(tiny_checkpoints[variant]))
    source.save_pretrained(tmp_path / "source", max_shard_size="60KB")  # sharded: layers span files
    family = family_for_surgery(source.config.model_type)
    plan = plan_mla(inspect_config(source.config), kv_budget=0.5)
    windows = torch.randint(0, source.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0))
    refinement = Refinement(refine_steps, tokens=4 * 32)
    starts = short_prompt_starts(windows, short, seed=0) if short else None
    in_memory = convert(source, family, windows, plan, refinement=refinement, received=received, starts=starts)
    out = tmp_path / "streamed"
    out.mkdir()
    config, errors = convert_streamed(CheckpointReader(tmp_path / "source"), source.config, family, windows, plan, out,
                                      refinement=refinement, max_shard_size="60KB", received=received, starts=starts)
    config.save_pretrained(out)
    streamed = AutoModelForCausalLM.from_pretrained(out)
    assert len(errors) == (source.config.num_hidden_layers if refine_steps else 0)
    assert [(e.steps, e.start) for e in errors] == [(e.steps, e.start) for e in in_memory.layer_errors]
    ids = torch.randint(0, source.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, in_memory.model(ids).logits, rtol=1e-3, atol=1e-3)


def test_streamed_output_is_written_in_the_dtype_asked(tiny_checkpoints, tmp_path):
    source = with_mean_direction(AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"]))
    source.save_pretrained(tmp_path / "source")
    plan = plan_mla(inspect_config(source.config), kv_budget=0.5)
    windows = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    (tmp_path / "out").mkdir()
    config, _ = convert_streamed(CheckpointReader(tmp_path / "source"), source.config, family_for_surgery("llama"),
                                 windows, plan, tmp_path / "out", dtype=torch.bfloat16)
    config.save_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.dtype == torch.bfloat16 and model.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.bfloat16


def test_convert_stream_writes_the_checkpoint_convert_writes(tiny_checkpoints, corpus_file, tmp_path):
    from typer.testing import CliRunner

    from attnsurg.cli import app

    runner = CliRunner()
    common = ["convert", str(tiny_checkpoints["qwen2"]), "--calib-text", str(corpus_file), "--calib-tokens", "512",
              "--calib-seq-len", "64", "--refine-steps", "3", "--refine-tokens", "256", "--eval-tokens", "128", "--eval-domains", "none"]
    reports = {}
    for name, extra in (("loaded", ["--no-stream"]), ("streamed", ["--stream"])):
        result = runner.invoke(app, common + extra + ["--json", "-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        reports[name] = json.loads(result.stdout)
        assert reports[name]["streamed"] == (name == "streamed")
    for score in ("ppl_before", "ppl_after"):  # the streamed run scores the source and what it wrote, a module at a time
        assert reports["streamed"][score] == pytest.approx(reports["loaded"][score], rel=1e-3)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "loaded")
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")
    ids = torch.randint(0, loaded.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, loaded(ids).logits, rtol=1e-3, atol=1e-3)
    assert_streamed_like_loaded(tmp_path / "loaded", tmp_path / "streamed")
    refused = runner.invoke(app, common + ["--stream", "--short-prompts", "0.25", "--token-weights", "received", "-o",
                                           str(tmp_path / "never")])
    assert refused.exit_code == 2 and "--short-prompts" in refused.output and not (tmp_path / "never").exists()


PEAK_OF_CHILD = """
import resource, runpy, sys
import attnsurg.cli, attnsurg.methods.mla.stream  # what the run imports, counted before it starts
def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sys.argv, before = ['attnsurg', *sys.argv[1:]], peak()
try:
    runpy.run_module('attnsurg', run_name='__main__')
finally:
    print('peak-kb', before, peak(), file=sys.stderr)
"""


def resident_growth(args: list[str]) -> int:
    """``attnsurg ARGS`` in a child process: how far its peak resident memory rose above the peak that importing
    the libraries had reached."""
    child = subprocess.run([sys.executable, "-c", PEAK_OF_CHILD, *args], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    before, peak = map(int, child.stderr.rsplit("peak-kb", 1)[1].split()[:2])
    return (peak - before) * 1024


def test_a_streamed_conversion_holds_far_less_than_the_checkpoint(tokenizer, corpus_file, tmp_path):
    """Memory a streamed conversion takes beyond the libraries it imports stays under half the source checkpoint's
    size: one layer in float32 and its fit, never the model or the finished output (each tensor goes straight
    into its shard). Loading the bf16 source in float32 alone would take twice its size."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=8192, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, eos_token_id=0,
                         tie_word_embeddings=False)  # large layers, quick to convert: 26 MB of bf16 each
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "wide")
    tokenizer.save_pretrained(tmp_path / "wide")
    size = sum(path.stat().st_size for path in (tmp_path / "wide").glob("*.safetensors"))
    growth = resident_growth(["convert", str(tmp_path / "wide"), "--to", "mla", "--stream", "--calib-text",
                              str(corpus_file), "--calib-tokens", "256", "--calib-seq-len", "64", "--refine-steps", "3",
                              "--refine-tokens", "128", "--eval-tokens", "0", "-o", str(tmp_path / "out")])
    assert (tmp_path / "out" / "config.json").is_file()
    assert growth < 0.5 * size, f"{growth / 1e6:.0f} MB beyond the imports, source {size / 1e6:.0f} MB"
