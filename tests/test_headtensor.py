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
from attnsurg.methods import cp, head_whitening, headtensor, tucker
from attnsurg.methods.base import operate_loaded
from attnsurg.methods.headtensor import plan_head_tensor
from attnsurg.modeling.modeling_attnsurg import CPProjection, TuckerProjection

from conftest import build_tiny, greedy_decode_matches_recomputation
from helpers import VOCAB, calibration, held_out, logit_error, remote_code_matches_attnsurg


def decomposed(model, family: str, stats, **plan_args):
    plan = plan_head_tensor(inspect_config(model.config), **plan_args)
    return operate_loaded(model, family_for_surgery(family), stats, plan, 512)


@pytest.mark.parametrize(
    "family, targets, ranks",
    [
        ("llama", "q,o", (4, 16, 64)),  # 4 heads x 16 dims x hidden 64
        ("llama", "k,v", (2, 16, 32)),  # 2 KV heads: the hidden mode has rank at most 2 x 16
        ("qwen2", "q,k", None),  # with biases; ranks per target below
        ("qwen3", "q,k", None),  # q/k norms after the decomposed projections
    ],
)
def test_full_tucker_ranks_reproduce_the_logits(family, targets, ranks):
    model = build_tiny(family, VOCAB, num_key_value_heads=2)
    stats = calibration(model, family)
    plans = [(targets, ranks)] if ranks else [("q", (4, 16, 64)), ("k", (2, 16, 32))]
    for target, full in plans:
        result = decomposed(model, family, stats, method="tucker", targets=target, ranks=full)
        assert logit_error(result.model, model, held_out()) < 1e-4


def test_cp_error_falls_as_the_rank_grows():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    stats = calibration(model, "llama")
    errors = [logit_error(decomposed(model, "llama", stats, method="cp", targets="q,k,v,o", ranks=(r,)).model,
                          model, held_out(), "mse") for r in (4, 16, 48)]
    assert errors[0] > errors[1] > errors[2]


def test_tucker_error_falls_as_the_budget_grows():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    stats = calibration(model, "llama")
    results = [decomposed(model, "llama", stats, method="tucker", targets="q,k,v,o", ratio=r) for r in (0.25, 0.6, 0.9)]
    errors = [logit_error(r.model, model, held_out(), "mse") for r in results]
    fit_errors = [sum(r.errors) for r in results]  # relative error of the whitened tensors: the objective
    assert errors[0] > errors[1] > errors[2] and fit_errors[0] > fit_errors[1] > fit_errors[2]


def test_chosen_tucker_ranks_stay_within_each_budget():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    result = decomposed(model, "llama", calibration(model, "llama"), method="tucker", targets="q,k,v,o", ratio=0.5)
    plan = result.plan
    for unit, ranks, budget in zip(plan.units, plan.ranks, plan.budgets):
        assert ranks is not None and tucker.parameters(unit.shape, ranks) <= budget


def test_allocation_moves_a_layers_budget_to_the_projections_that_lose_most():
    """Tucker --allocate: each layer spends no more than its uniform budget, no projection gets less than the
    floor of its own, the summed relative whitened error is no higher than the uniform split's, and the error
    still falls as the budget grows (full ranks are the exactness test's: a Tucker ratio of 1.0 keeps the
    parameter count, not the rank)."""
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    stats = calibration(model, "llama")
    uniform = decomposed(model, "llama", stats, method="tucker", targets="q,k,v,o", ratio=0.5)
    spread = decomposed(model, "llama", stats, method="tucker", targets="q,k,v,o", ratio=0.5, allocate=True)
    plan = spread.plan
    for layer in {u.layer for u in plan.units}:
        units = [i for i, u in enumerate(plan.units) if u.layer == layer]
        spent = sum(tucker.parameters(plan.units[i].shape, plan.ranks[i]) for i in units if plan.ranks[i])
        assert spent <= sum(uniform.plan.budgets[i] for i in units)
        assert all(plan.budgets[i] >= int(headtensor.ALLOCATION_FLOOR * uniform.plan.budgets[i]) for i in units)
    assert sum(e**2 for e in spread.errors) <= sum(e**2 for e in uniform.errors) * 1.02
    assert plan.budgets != uniform.plan.budgets
    errors = [logit_error(decomposed(model, "llama", stats, method="tucker", targets="q,k,v,o", ratio=r,
                                     allocate=True).model, model, held_out(), "mse") for r in (0.25, 0.6, 0.9)]
    assert errors[0] > errors[1] > errors[2]


def test_allocation_is_for_a_tucker_ratio_only():
    from attnsurg.methods.headtensor import HeadTensorSettings

    for bad in ({"method": "cp", "ratio": 0.5}, {"method": "tucker", "ranks": (4, 8, 24)},
                {"method": "tucker", "ratio": 0.5, "stacked": True}):
        with pytest.raises(ValueError, match="allocate spreads a Tucker --ratio"):
            HeadTensorSettings(**bad, allocate=True)


@pytest.mark.parametrize("method, ranks, module", [("tucker", (4, 8, 24), TuckerProjection), ("cp", (12,), CPProjection)])
def test_factors_are_shared_across_heads(method, ranks, module):
    """One tensor per mode in the state dict, whatever the number of heads."""
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    result = decomposed(model, "llama", calibration(model, "llama"), method=method, targets="q", ranks=ranks)
    q = result.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, module)
    state = {k.removeprefix("model.layers.0.self_attn.q_proj."): v for k, v in result.model.state_dict().items()
             if k.startswith("model.layers.0.self_attn.q_proj.")}
    expected = {"factor_heads", "factor_dim", "factor_hidden"} | ({"core"} if method == "tucker" else set())
    assert set(state) == expected
    rank_hidden = ranks[-1]
    assert state["factor_hidden"].shape == (64, rank_hidden)  # the hidden basis: one tensor for all 4 heads
    assert state["factor_heads"].shape[0] == 4


def test_unconverged_decomposition_keeps_its_factors_and_says_so(monkeypatch, capsys):
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    monkeypatch.setattr(headtensor, "MAX_ITERATIONS", 1)
    result = decomposed(model, "llama", calibration(model, "llama"), method="cp", targets="q", ranks=(24,))
    assert all(0 < e < 1 for e in result.errors)
    assert torch.isfinite(result.model(held_out()).logits).all()
    message = capsys.readouterr().err
    assert "2 of 2 cp decompositions stopped at the cap of 1 iterations" in message and "largest relative error" in message


def test_cp_decomposition_with_the_cap_reached_returns_its_best_fit():
    torch.manual_seed(0)
    T = torch.randn(3, 8, 20, dtype=torch.float64)
    short, longer = cp.decompose(T, (6,), 1, 1e-12, 0), cp.decompose(T, (6,), 30, 1e-12, 0)
    assert not short.converged and longer.relative_error <= short.relative_error


@pytest.mark.parametrize(
    "method, kwargs, fragment",
    [
        ("tucker", {"ranks": (4, 17, 64)}, "does not fit"),
        ("tucker", {"ranks": (0, 16, 64)}, "does not fit"),
        ("tucker", {"ranks": (4, 16)}, "give 3 ranks"),
        ("cp", {"ranks": (0,)}, "from 1 to"),
        ("cp", {"ranks": (65,)}, "from 1 to 64"),
        ("cp", {"ratio": 1.2}, r"\(0, 1\]"),
        ("cp", {"ratio": 0.5, "ranks": (4,)}, "exactly one"),
    ],
)
def test_bad_ranks(method, kwargs, fragment):
    anatomy = inspect_config(build_tiny("llama", VOCAB, num_key_value_heads=2).config)
    with pytest.raises(UserError, match=fragment):
        plan_head_tensor(anatomy, method, "q,k,v,o", **kwargs)


def test_cli_bad_ranks_exit_2(tiny_checkpoints, tmp_path):
    for args in (["--method", "tucker", "--ranks", "4,16,65"], ["--method", "tucker", "--rank", "4"],
                 ["--method", "cp", "--rank", "4", "--kv-latent"], ["--method", "tucker", "--ranks", "a,b"]):
        result = CliRunner().invoke(app, ["compress", str(tiny_checkpoints["llama-gqa"]), *args, "-o", str(tmp_path / "x")])
        assert result.exit_code == 2, result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def cp_checkpoint(tiny_checkpoints, corpus_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "cp50"
    args = ["compress", str(tiny_checkpoints["qwen2"]), "--method", "cp", "--ratio", "0.5", "--calib-text", str(corpus_file),
            "--calib-tokens", "512", "--eval-tokens", "256", "--eval-domains", "none", "-o", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_cp_checkpoint_reloads_equal_in_attnsurg_and_with_remote_code(cp_checkpoint, tmp_path):
    out, record = cp_checkpoint
    assert record["kept_fraction"] <= 0.5 and record["ppl_after"] > 0
    config = json.loads((out / "config.json").read_text())
    spec = config["attnsurg"]["head_tensor"]["model.layers.0.self_attn.q_proj"]
    assert spec["kind"] == "cp" and spec["heads_on"] == "output"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.layers.0.self_attn.o_proj.factor_hidden" in set(f.keys())
        assert "model.layers.0.self_attn.q_proj.weight" not in set(f.keys())
    assert remote_code_matches_attnsurg(out, tmp_path)


def test_tucker_reload_equals_in_memory(tiny_checkpoints, tmp_path):
    from attnsurg.io.card import CardInfo
    from attnsurg.io.save import write_checkpoint

    source = load_model(resolve_source(str(tiny_checkpoints["llama-mha"])))
    result = decomposed(source, "llama", calibration(source, "llama"), method="tucker", targets="q,k,v,o", ratio=0.5)
    write_checkpoint(result.model, None, tmp_path / "out", CardInfo(title="t", summary="s"))
    reloaded = load_model(resolve_source(str(tmp_path / "out")))
    assert logit_error(result.model, reloaded, held_out()) == 0.0


def test_cli_tucker_dry_run_names_the_modes(tiny_checkpoints):
    result = CliRunner().invoke(app, ["compress", str(tiny_checkpoints["llama-gqa"]), "--method", "tucker",
                                      "--ranks", "4,8,32", "--targets", "q", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert record["plan"][0]["q"] == [4, 8, 32] and record["written"] is None


@pytest.mark.parametrize("method, ranks, family", [("cp", (8,), "qwen2"), ("tucker", (2, 12, 8), "qwen2"), ("tucker", (2, 12, 8), "qwen3")])
def test_narrow_kv_factors_are_what_the_cache_holds(method, ranks, family):
    """k and v with hidden ranks 8 + 8 < 2 x 2 x 16: the cache holds 16 values per token, and decoding
    with it gives the same tokens as recomputing from scratch."""
    from transformers import DynamicCache

    from attnsurg.modeling.modeling_attnsurg import FactoredKVAttention

    model = build_tiny(family, VOCAB, num_key_value_heads=2)
    result = decomposed(model, family, calibration(model, family), method=method, targets="k,v", ranks=ranks)
    compressed = result.model
    assert isinstance(compressed.model.layers[0].self_attn, FactoredKVAttention)
    assert result.plan.kv_values_after() == 2 * 16
    assert inspect_config(compressed.config).kv_values_per_token == 2 * 16
    cache = DynamicCache(config=compressed.config)
    with torch.no_grad():
        compressed(held_out()[:1, :10], cache=cache, use_cache=True)
    assert sum(t.shape[-1] for t in (cache.layers[0].keys, cache.layers[0].values)) == 16
    assert greedy_decode_matches_recomputation(compressed, held_out()[:1, :8], 12)


def test_full_rank_tucker_kv_keeps_the_plain_cache():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    result = decomposed(model, "llama", calibration(model, "llama"), method="tucker", targets="k,v", ranks=(2, 16, 32))
    assert result.plan.factored_kv() == {}  # 32 + 32 is the full 2 G d: nothing to save


@pytest.mark.parametrize("name", ["k", "o"])
@torch.no_grad()
def test_hidden_factor_refit_lowers_the_exact_objective(name):
    """The closed-form refit is the weighted least-squares optimum for the hidden factor, so the exact
    objective (per-head consumer weights for k, the full input covariance for o) can only fall."""
    from attnsurg.methods.consumers import layer_contexts

    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    stats = calibration(model, "llama")
    plan = plan_head_tensor(inspect_config(model.config), "cp", name, ranks=(6,))
    unit, attn = plan.units[0], model.model.layers[0].self_attn
    weight = getattr(attn, f"{name}_proj").weight
    x = stats[0][1] if name == "o" else stats[0][0]
    consumer = head_whitening.consumer_blocks(unit, layer_contexts(model, family_for_surgery("llama"), stats, 64)[0])
    w = head_whitening.whiten(unit, weight, x, consumer)
    state = head_whitening.module_state(plan, cp.decompose(w.tensor, (6,), 50, 1e-5, 0).factors, w, None)

    def objective() -> float:
        K, C = head_whitening.head_maps(state), state["factor_hidden"]
        if name == "o":
            delta = weight.detach().double() - C @ K.T
            return float(torch.trace(delta @ x.sigma[:-1, :-1] @ delta.T))
        delta = weight.detach().double() - K @ C.T
        return float(torch.trace(torch.block_diag(*consumer) @ delta @ x.sigma[:-1, :-1] @ delta.T))

    before = objective()
    head_whitening.refit_hidden_factor(unit, state, weight, x, consumer)
    assert objective() < before
