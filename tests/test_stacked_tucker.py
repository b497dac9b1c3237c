import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.cli import app
from attnsurg.errors import UserError
from attnsurg.io.load import load_model, resolve_source
from attnsurg.methods import stacked_tucker
from attnsurg.methods.consumers import layer_contexts
from attnsurg.methods.base import operate_loaded
from attnsurg.methods.stacked_tucker import plan_stacked_tucker
from attnsurg.modeling.modeling_attnsurg import StackedTuckerAttention

from conftest import build_tiny, greedy_decode_matches_recomputation
from helpers import VOCAB, calibration, held_out, logit_error, remote_code_matches_attnsurg

ALL = ("q", "k", "v", "o")


def stacked(model, family: str, stats, **plan_args):
    plan = plan_stacked_tucker(inspect_config(model.config), ALL, **plan_args)
    return operate_loaded(model, family_for_surgery(family), stats, plan, 512)


@pytest.mark.parametrize("family, kv_heads", [("llama", 2), ("llama", 4), ("qwen2", 2), ("mistral", 2), ("qwen3", 2)])
def test_full_ranks_reproduce_the_logits(family, kv_heads):
    model = build_tiny(family, VOCAB, num_key_value_heads=kv_heads)
    result = stacked(model, family, calibration(model, family), ranks=(16, 64))  # head_dim 16, hidden 64
    assert isinstance(result.model.model.layers[0].self_attn, StackedTuckerAttention)
    assert logit_error(result.model, model, held_out()) < 1e-4


def test_error_falls_as_the_budget_grows():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    stats = calibration(model, "llama")
    results = [stacked(model, "llama", stats, ratio=r) for r in (0.2, 0.35, 0.5)]
    errors = [logit_error(r.model, model, held_out(), "mse") for r in results]
    fit_errors = [sum(r.errors) for r in results]
    assert errors[0] > errors[1] > errors[2] and fit_errors[0] > fit_errors[1] > fit_errors[2]


@pytest.mark.parametrize("ranks", [(16, 24), (8, 24)])  # full head_dim (B folded), and a fitted B
@torch.no_grad()
def test_alternating_fit_never_raises_the_objective_and_beats_the_data_free_start(ranks):
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    stats = calibration(model, "llama")
    plan = plan_stacked_tucker(inspect_config(model.config), ALL, ranks=ranks)
    context = layer_contexts(model, family_for_surgery("llama"), stats, 64)[0]
    layer = stacked_tucker.stack_layer(plan.units[0], model.model.layers[0].self_attn, *stats[0], context)
    fit = stacked_tucker.fit_layer(layer, ranks, seed=0)
    steps = torch.tensor(fit.objectives)
    assert (steps[1:] <= steps[:-1] * (1 + 1e-9)).all()
    assert fit.objectives[-1] < 0.9 * fit.objectives[0]


def test_factors_are_shared_across_heads_and_projections():
    """One hidden factor and one head-dim factor per layer; a core per projection; no dense weights."""
    model = build_tiny("qwen2", VOCAB, num_key_value_heads=2)
    result = stacked(model, "qwen2", calibration(model, "qwen2"), ranks=(8, 24))
    prefix = "model.layers.0.self_attn."
    shapes = {k.removeprefix(prefix): tuple(v.shape) for k, v in result.model.state_dict().items() if k.startswith(prefix)}
    assert shapes == {"factor_hidden": (64, 24), "factor_dim": (16, 8), "core_q": (4, 8, 24), "core_k": (2, 8, 24),
                      "core_v": (2, 8, 24), "core_o": (4, 8, 24), "q_bias": (64,), "k_bias": (32,), "v_bias": (32,)}


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_narrow_hidden_rank_is_what_the_cache_holds(family):
    """Hidden rank 24 < 2 G d = 64: the cache holds 24 values per token and per layer, and decoding with it
    gives the tokens that recomputing from scratch gives."""
    from transformers import DynamicCache

    model = build_tiny(family, VOCAB, num_key_value_heads=2)
    compressed = stacked(model, family, calibration(model, family), ranks=(16, 24)).model
    assert inspect_config(compressed.config).kv_values_per_token == 2 * 24
    cache = DynamicCache(config=compressed.config)
    with torch.no_grad():
        compressed(held_out()[:1, :10], cache=cache, use_cache=True)
    assert sum(t.shape[-1] for t in (cache.layers[0].keys, cache.layers[0].values)) == 24
    assert greedy_decode_matches_recomputation(compressed, held_out()[:1, :8], 12)


def test_wide_hidden_rank_caches_keys_and_values():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    result = stacked(model, "llama", calibration(model, "llama"), ranks=(16, 64))
    assert result.plan.kv_values_after() == inspect_config(model.config).kv_values_per_token
    assert not result.model.model.layers[0].self_attn.cache_latent
    prompt = held_out()[:1, :8]
    generated = result.model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6, eos_token_id=None)
    assert torch.equal(generated, model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6, eos_token_id=None))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"ranks": (17, 32)}, "from 1 to 16"),
        ({"ranks": (16, 0)}, "does not fit"),
        ({"ranks": (4, 16, 64)}, "give 2 ranks"),
        ({"ratio": 0.0}, r"\(0, 1\]"),
        ({"ratio": 0.001}, "no hidden rank"),
        ({"ratio": 0.5, "ranks": (16, 8)}, "exactly one"),
    ],
)
def test_bad_ranks(kwargs, fragment):
    anatomy = inspect_config(build_tiny("llama", VOCAB, num_key_value_heads=2).config)
    with pytest.raises(UserError, match=fragment):
        plan_stacked_tucker(anatomy, ALL, **kwargs)


def test_cli_bad_requests_exit_2(tiny_checkpoints, tmp_path):
    for args in (["--method", "tucker", "--stacked", "--ranks", "4,16,64"], ["--method", "cp", "--stacked", "--rank", "4"],
                 ["--method", "tucker", "--stacked", "--ratio", "0.5", "--targets", "q,k"],
                 ["--method", "svdllm", "--stacked", "--ratio", "0.5"]):
        result = CliRunner().invoke(app, ["compress", str(tiny_checkpoints["llama-gqa"]), *args, "-o", str(tmp_path / "x")])
        assert result.exit_code == 2, result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_recipe_refuses_stacked_cp():
    from attnsurg.io.recipe_file import parse_recipe

    text = "model: m\noutput: o\nsteps:\n- compress:\n    method: cp\n    rank: 4\n    stacked: true\n"
    with pytest.raises(UserError, match="stacked is a Tucker layout"):
        parse_recipe(text, "r.yaml")


def test_checkpoint_reloads_equal_in_attnsurg_and_with_remote_code(tiny_checkpoints, corpus_file, tmp_path):
    out = tmp_path / "st"
    args = ["compress", str(tiny_checkpoints["qwen2"]), "--method", "tucker", "--stacked", "--ranks", "8,24",
            "--calib-text", str(corpus_file), "--calib-tokens", "512", "--eval-tokens", "256", "--eval-domains", "none", "-o", str(out),
            "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["plan"][0]["qkvo"] == [8, 24] and record["kv_values_per_token"][1] < record["kv_values_per_token"][0]
    config = json.loads((out / "config.json").read_text())
    assert config["attnsurg"]["stacked_tucker"]["0"] == {"ranks": [8, 24], "cache_latent": True}
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.factor_hidden" in keys and "model.layers.0.self_attn.q_proj.weight" not in keys
    assert remote_code_matches_attnsurg(out, tmp_path)


def test_reload_equals_in_memory(tiny_checkpoints, tmp_path):
    from attnsurg.io.card import CardInfo
    from attnsurg.io.save import write_checkpoint

    source = load_model(resolve_source(str(tiny_checkpoints["llama-gqa"])))
    result = stacked(source, "llama", calibration(source, "llama"), ratio=0.5)
    write_checkpoint(result.model, None, tmp_path / "out", CardInfo(title="t", summary="s"))
    reloaded = load_model(resolve_source(str(tmp_path / "out")))
    assert logit_error(result.model, reloaded, held_out()) == 0.0
