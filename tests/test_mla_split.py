"""``methods/mla/split.py``: the RoPE width of a KV budget chosen on the model's own held-out errors."""

import json

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
from attnsurg.io.lazy import CheckpointReader
from attnsurg.methods.mla.split import SPLIT_HELD_OUT, merged, split_candidates, streamed_split

from conftest import build_tiny, with_mean_direction

LLAMA = family_for_surgery("llama")
WINDOWS = torch.randint(0, 384, (6, 64), generator=torch.Generator().manual_seed(1))


def measured(kv_heads: int):
    model = with_mean_direction(build_tiny("llama", 384, num_key_value_heads=kv_heads, head_dim=32))
    candidates = split_candidates(inspect_config(model.config), 0.5)
    return convert(model, LLAMA, WINDOWS, candidates[0], candidates=candidates)


def test_each_model_gets_the_split_its_own_held_out_errors_favour():
    """Two KV heads of 32 at half budget (64 values) lose least with a narrow RoPE key and a wide latent; four
    (128 values) with the whole head dim in RoPE: the same budget share, split differently by measurement."""
    chosen = {}
    for kv_heads in (2, 4):
        result = measured(kv_heads)
        errors = result.split.errors
        assert result.plan == result.split.chosen and len(errors) == len(result.split.plans) > 1
        assert errors[result.split.plans.index(result.plan)] == min(errors)
        assert all(f"{e:.4f}" in result.split.reason() for e in errors)
        chosen[kv_heads] = result.plan.rope_dim
    assert chosen == {2: 8, 4: 32}
    assert plan_mla(inspect_config(build_tiny("llama", 384, num_key_value_heads=2, head_dim=32).config),
                    kv_budget=0.5).rope_dim == 16  # the rule would have spent twice the RoPE width


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_a_streamed_measurement_scores_the_splits_as_a_loaded_one(kv_heads, tmp_path):
    """One layer in memory at a time, the candidates get the loaded model's held-out errors and the same choice."""
    model = with_mean_direction(build_tiny("llama", 384, num_key_value_heads=kv_heads, head_dim=32))
    model.save_pretrained(tmp_path / "source", max_shard_size="100KB")
    candidates = split_candidates(inspect_config(model.config), 0.5)
    loaded = convert(model, LLAMA, WINDOWS, candidates[0], candidates=candidates).split
    streamed = streamed_split(CheckpointReader(tmp_path / "source"), model.config, LLAMA, WINDOWS, candidates, True)
    assert streamed.chosen == loaded.chosen and len(streamed.errors) == len(candidates) > 1
    assert streamed.errors == pytest.approx(loaded.errors, rel=1e-4)


def test_candidates_halve_the_head_dim_and_leave_the_latent_at_least_half():
    anatomy = inspect_config(build_tiny("llama", 384, num_key_value_heads=4, head_dim=32).config)
    assert [p.rope_dim for p in split_candidates(anatomy, 0.5)] == [32, 16, 8]
    assert [p.rope_dim for p in split_candidates(anatomy, 0.125)] == [16, 8]
    assert [p.rope_fold for p in split_candidates(anatomy, 0.125)] == [2, 4]
    full = split_candidates(anatomy, 1.0)
    assert len(full) == 1 and full[0] == plan_mla(anatomy, kv_budget=1.0)


def test_statistics_of_two_passes_merged_equal_one_pass_over_all_windows():
    model = build_tiny("llama", 384, num_key_value_heads=2)
    attentions = attention_layers(model, LLAMA)
    whole = input_statistics(model, attentions, WINDOWS, received=attentions)
    parts = [merged(a, b) for a, b in zip(input_statistics(model, attentions, WINDOWS[:-SPLIT_HELD_OUT], received=attentions),
                                          input_statistics(model, attentions, WINDOWS[-SPLIT_HELD_OUT:], received=attentions))]
    for one, two in zip(whole, parts):
        for name in ("sigma", "sigma_first", "sigma_received", "abs_mean"):
            torch.testing.assert_close(getattr(two, name), getattr(one, name), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_the_command_prints_and_records_the_splits_it_compared(stream, tiny_checkpoints, tmp_path, corpus_file):
    result = CliRunner().invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "mla", "--kv-budget", "0.5", "-o", str(tmp_path / "out"),
                                      "--split", "measured", "--calib-text", str(corpus_file), "--calib-tokens", "384",
                                      "--calib-seq-len", "64", "--refine-steps", "0", "--eval-tokens", "0",
                                      "--eval-domains", "none", "--json", stream])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["streamed"] == (stream == "--stream")
    split = record["split"]
    assert len(split["candidates"]) == 2 and split["chosen_rope_dim"] == record["plan"][0]["rope_dims"]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.qk_rope_head_dim == split["chosen_rope_dim"]
    assert "split: RoPE" in (tmp_path / "out" / "README.md").read_text()
    assert all(f"{c['error']:.4f}" in record["split_reason"] for c in split["candidates"])


def test_the_plan_says_why_it_splits_the_budget_as_it_does(tiny_checkpoints):
    """Without a measurement the plan names the rule (or the width asked for, or the whole cache)."""
    def reason(*options) -> str:
        result = CliRunner().invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "mla", "--dry-run", "--json",
                                          *options])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["split_reason"]

    assert "the widest head_dim / 2^k within a third of the" in reason("--kv-budget", "0.5")
    assert reason("--kv-budget", "0.5", "--rope-dim", "2").endswith("the RoPE width asked for")
    assert reason("--kv-budget", "1.0").endswith("the whole cache")


@pytest.mark.parametrize("options,fragment", [
    (["--rope-dim", "16"], "drop --rope-dim/--rope-fold"),
    (["--kv-rank", "24"], "with --kv-rank give --rope-dim"),
    (["--calib-tokens", "128"], "calibrate on more than 2 windows"),
])
def test_measured_splits_it_cannot_make_are_one_line(tiny_checkpoints, options, fragment, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "mla", "--split", "measured",
                                      "-o", str(tmp_path / "out"), "--calib-seq-len", "64", *options])
    assert result.exit_code == 2 and fragment in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()
