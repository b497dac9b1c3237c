"""The streamed conversion writes what the in-memory one builds, reading one layer at a time."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.io.lazy import CheckpointReader
from attnsurg.methods.mla import Refinement, convert, plan_mla
from attnsurg.methods.mla_stream import convert_streamed

from conftest import assert_streamed_like_loaded, with_mean_direction


@pytest.mark.parametrize("variant,refine_steps", [("llama-gqa", 0), ("qwen2", 5), ("llama-mha", 5)])
def test_streamed_conversion_equals_the_in_memory_one(variant, refine_steps, tiny_checkpoints, tmp_path):
    source = with_mean_direction(AutoModelForCausalLM.from_pretrained(tiny_checkpoints[variant]))
    source.save_pretrained(tmp_path / "source", max_shard_size="60KB")  # sharded: layers span files
    family = family_for_surgery(source.config.model_type)
    plan = plan_mla(inspect_config(source.config), kv_budget=0.5)
    windows = torch.randint(0, source.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0))
    refinement = Refinement(refine_steps, tokens=4 * 32)
    in_memory = convert(source, family, windows, plan, refinement=refinement)
    out = tmp_path / "streamed"
    out.mkdir()
    config, errors = convert_streamed(CheckpointReader(tmp_path / "source"), source.config, family, windows, plan, out,
                                      refinement=refinement, max_shard_size="60KB")
    config.save_pretrained(out)
    streamed = AutoModelForCausalLM.from_pretrained(out)
    assert len(errors) == (source.config.num_hidden_layers if refine_steps else 0)
    assert [e.steps for e in errors] == [e.steps for e in in_memory.layer_errors]
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
              "--calib-seq-len", "64", "--refine-steps", "3", "--refine-tokens", "256", "--eval-tokens", "0"]
    for name, extra in (("loaded", []), ("streamed", ["--stream"])):
        result = runner.invoke(app, common + extra + ["-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "loaded")
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")
    ids = torch.randint(0, loaded.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, loaded(ids).logits, rtol=1e-3, atol=1e-3)
    assert_streamed_like_loaded(tmp_path / "loaded", tmp_path / "streamed")
    refused = runner.invoke(app, common + ["--stream", "--short-prompts", "0.25", "-o", str(tmp_path / "never")])
    assert refused.exit_code == 2 and "--short-prompts" in refused.output and not (tmp_path / "never").exists()
