import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import InputStatistics
from attnsurg.cli import app
from attnsurg.errors import UserError
from attnsurg.io.load import load_model, resolve_source
from attnsurg.linalg import cholesky_whitening
from attnsurg.methods.base import operate_loaded
from attnsurg.methods.lowrank import Unit, plan_lowrank
from attnsurg.methods.rank_allocation import allocate_ranks
from attnsurg.modeling.modeling_attnsurg import LatentKVAttention, LowRankLinear

from conftest import build_tiny, greedy_decode_matches_recomputation
from helpers import VOCAB, calibration, held_out, logit_error, remote_code_matches_attnsurg

def compressed(model, family: str, stats, **plan_args):
    plan = plan_lowrank(inspect_config(model.config), **plan_args)
    return operate_loaded(model, family_for_surgery(family), stats, plan, 64).model


@pytest.mark.parametrize("method", ["svd", "asvd", "svdllm"])
@pytest.mark.parametrize(
    "family, kv_heads, targets, rank, kv_latent",
    [
        ("llama", 4, "q,k,v,o", 64, False),  # MHA: every projection 64 x 64
        ("llama", 2, "k,v", 32, False),  # GQA: k/v have G d = 32 rows
        ("llama", 2, "k,v", 64, True),  # joint latent of [K; V], 64 rows
        ("qwen2", 2, "k,v", 64, True),  # with k/v biases
        ("qwen2", 2, "q,o", 64, False),
        ("qwen3", 2, "q,o", 64, False),  # q/k norms after the factorized projections
        ("qwen3", 2, "k,v", 32, False),
        ("qwen3", 2, "k,v", 64, True),  # the latent's rebuilt keys go through the key norm
    ],
)
def test_full_rank_reproduces_the_logits(method, family, kv_heads, targets, rank, kv_latent):
    model = build_tiny(family, VOCAB, num_key_value_heads=kv_heads)
    stats = calibration(model, family)
    result = compressed(model, family, stats, method=method, targets=targets, rank=rank, kv_latent=kv_latent)
    assert logit_error(result, model, held_out()) < 1e-4


@pytest.mark.parametrize("family, kv_latent, targets", [("llama", False, "q,k,v,o"), ("llama", True, "k,v"), ("qwen3", True, "k,v")])
def test_error_falls_as_the_budget_grows(family, kv_latent, targets):
    model = build_tiny(family, VOCAB, num_key_value_heads=2)
    stats = calibration(model, family)
    errors = [
        logit_error(compressed(model, family, stats, method="svdllm", targets=targets, ratio=r, kv_latent=kv_latent),
                    model, held_out(), "mse")
        for r in (0.25, 0.5, 0.75)
    ]
    assert errors[0] > errors[1] > errors[2]


def test_whitening_beats_plain_svd_on_held_out_projection_outputs():
    """SVD-LLM minimizes the output error on the calibration inputs; it should also win on fresh inputs
    whose channels differ in scale, as real models' do (outlier channels)."""
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.copy_(torch.logspace(1, -1, 64)[torch.randperm(64, generator=torch.Generator().manual_seed(0))])
    stats = calibration(model, "llama", n=8)
    fresh = calibration(model, "llama", n=4, seed=7)
    errors = {}
    for method in ("svd", "svdllm"):
        result = compressed(model, "llama", stats, method=method, targets="k,v", rank=8, weighted=False)
        total = 0.0
        for layer, (x, _) in enumerate(fresh):
            for name in ("k_proj", "v_proj"):
                dense = model.model.layers[layer].self_attn.get_submodule(name)
                low = result.model.layers[layer].self_attn.get_submodule(name)
                W = dense.weight.detach().double()
                W_low = (low.up.weight @ low.down.weight).detach().double()
                D = W - W_low
                total += float(torch.trace(D @ x.sigma[:-1, :-1] @ D.T).detach())
        errors[method] = total
    assert errors["svdllm"] < 0.9 * errors["svd"]


def test_singular_covariance_does_not_crash():
    singular = torch.zeros(6, 6, dtype=torch.float64)
    singular[:2, :2] = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    S = cholesky_whitening(singular)
    assert torch.isfinite(S).all()
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    stats = calibration(model, "llama", n=1, length=8)  # 8 tokens, 64 channels: rank-deficient
    result = compressed(model, "llama", stats, method="svdllm", targets="q,k,v,o", ratio=0.5)
    assert torch.isfinite(result(held_out()).logits).all()


def test_allocation_minimizes_the_summed_relative_error_within_the_budget():
    """Greedy water-filling against an exhaustive search over every split of the budget."""
    import itertools

    units = [Unit(i, "kv", 12, 12) for i in range(3)]
    spectra = [torch.linspace(10, 1, 12), torch.linspace(10, 9, 12), torch.logspace(1, -3, 12)]

    def total_error(ranks) -> float:
        return sum(float(s[r:].pow(2).sum() / s.pow(2).sum()) for s, r in zip(spectra, ranks))

    floors = [2, 2, 1]
    ranks = allocate_ranks(units, spectra, budget=15, floors=floors)
    feasible = (r for r in itertools.product(range(1, 13), repeat=3) if sum(r) <= 15 and all(map(int.__ge__, r, floors)))
    best = min(feasible, key=total_error)
    assert sum(ranks) == 15 and total_error(ranks) == pytest.approx(total_error(best))
    assert len(set(ranks)) > 1 and all(r >= f for r, f in zip(ranks, floors))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_latent_cache_decode_matches_recomputation(family):
    model = build_tiny(family, VOCAB, num_key_value_heads=2)
    result = compressed(model, family, calibration(model, family), method="svdllm", targets="k,v", ratio=0.5, kv_latent=True)
    assert greedy_decode_matches_recomputation(result, held_out()[:1, :8], 20)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_token_steps_mix_the_cached_latent_and_never_rebuild_the_values(family):
    """Batched, left-padded greedy decoding gives the logits of recomputing every prefix, and after the prompt
    kv_up (which rebuilds K and V together) is never called: each step rebuilds only the keys."""
    model = build_tiny(family, VOCAB, num_key_value_heads=2)
    result = compressed(model, family, calibration(model, family), method="svdllm", targets="k,v", ratio=0.5, kv_latent=True)
    rebuilt = []
    for module in result.modules():
        if isinstance(module, LatentKVAttention):
            module.kv_up.register_forward_hook(lambda m, args, out: rebuilt.append(args[0].shape[1]))
    prompt, mask = held_out()[:, :8], torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    generated = result.generate(prompt, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert rebuilt == [8, 8]  # each layer once, on the prompt
    full_mask = torch.cat([mask, torch.ones(2, 11, dtype=torch.long)], dim=1)
    with torch.no_grad():
        recomputed = result(generated.sequences[:, :-1], attention_mask=full_mask, use_cache=False).logits[:, 7:]
    torch.testing.assert_close(torch.stack(generated.logits, dim=1), recomputed, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def written(tiny_checkpoints, corpus_file, tmp_path_factory):
    """The tiny Llama GQA checkpoint compressed by the CLI to a 50% k/v latent."""
    out = tmp_path_factory.mktemp("lowrank") / "kv50"
    args = ["compress", str(tiny_checkpoints["llama-gqa"]), "--method", "svdllm", "--targets", "k,v", "--kv-latent",
            "--ratio", "0.5", "--calib-text", str(corpus_file), "--calib-tokens", "512", "--eval-tokens", "256", "--eval-domains", "none", "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def test_checkpoint_stores_factors_not_dense_weights(written):
    config = json.loads((written / "config.json").read_text())
    assert config["model_type"] == "attnsurg_llama"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_attnsurg.AttnsurgLlamaForCausalLM"
    assert config["attnsurg"]["kv_latent"] == {"0": 32, "1": 32}
    with safe_open(written / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.kv_down.weight" in keys
    assert not any(k.endswith(("k_proj.weight", "v_proj.weight")) for k in keys)
    assert (written / "modeling_attnsurg.py").is_file() and (written / "attnsurg_recipe.yaml").is_file()
    assert "Ranks per module" in (written / "README.md").read_text()


def test_loads_with_remote_code_and_with_attnsurg_alike(written, tmp_path):
    """A separate interpreter without attnsurg loads through the copied modeling file; same logits."""
    assert isinstance(load_model(resolve_source(str(written))).model.layers[0].self_attn, LatentKVAttention)
    assert remote_code_matches_attnsurg(written, tmp_path)


def test_anatomy_reports_the_latent_cache(written):
    from attnsurg.info import inspect_model
    from attnsurg.requests import ModelRef

    _, _, anatomy = inspect_model(ModelRef(ref=str(written)))
    assert anatomy.kv_values_per_token == 2 * 32  # two layers, latent rank 32 (was 2 x 64)
    assert anatomy.attention_kind == "gqa+latent"


def test_reload_equals_in_memory(tiny_checkpoints, tmp_path):
    from attnsurg.io.save import write_checkpoint
    from attnsurg.io.card import CardInfo

    source = load_model(resolve_source(str(tiny_checkpoints["qwen2"])))
    result = compressed(source, "qwen2", calibration(source, "qwen2"), method="asvd", targets="q,k,v,o", ratio=0.5)
    assert isinstance(result.model.layers[0].self_attn.q_proj, LowRankLinear)
    write_checkpoint(result, None, tmp_path / "out", CardInfo(title="t", summary="s"))
    reloaded = load_model(resolve_source(str(tmp_path / "out")))
    assert logit_error(result, reloaded, held_out()) == 0.0


def test_qwen3_latent_checkpoint_reloads_equal_with_and_without_remote_code(tokenizer, tmp_path):
    """Qwen3's q/k norms are part of the written attention: the reloaded model (attnsurg's loader and the copied
    modeling file alike) gives the in-memory model's logits."""
    from attnsurg.io.card import CardInfo
    from attnsurg.io.save import write_checkpoint
    from attnsurg.modeling import MODELING_FILE

    source = build_tiny("qwen3", VOCAB, num_key_value_heads=2)
    result = compressed(source, "qwen3", calibration(source, "qwen3"), method="svdllm", targets="k,v", ratio=0.5, kv_latent=True)
    write_checkpoint(result, tokenizer, tmp_path / "out", CardInfo(title="t", summary="s"),
                     extra_files={MODELING_FILE.name: MODELING_FILE.read_text(encoding="utf-8")})
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "attnsurg_qwen3"
    reloaded = load_model(resolve_source(str(tmp_path / "out")))
    assert reloaded.model.layers[0].self_attn.k_norm is not None
    assert logit_error(result, reloaded, held_out()) == 0.0
    assert remote_code_matches_attnsurg(tmp_path / "out", tmp_path)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"rank": 0}, "at least 1"),
        ({"rank": 33}, "exceeds the full rank 32"),
        ({"ratio": 0.0}, "(0, 1]"),
        ({"ratio": 1.5}, "(0, 1]"),
        ({"ratio": 0.5, "rank": 4}, "exactly one"),
        ({"ratio": 0.5, "targets": "q,x"}, "unknown target 'x'"),
        ({"ratio": 0.5, "kv_latent": True, "targets": "q,k,v"}, "--targets k,v"),
        ({"ratio": 0.5, "method": "pca"}, "unknown low-rank method"),
    ],
)
def test_bad_budgets_and_targets(kwargs, fragment):
    anatomy = inspect_config(build_tiny("llama", VOCAB, num_key_value_heads=2).config)
    args = {"method": "svdllm", "targets": "q,k,v,o", **kwargs}
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        plan_lowrank(anatomy, **args)


def test_the_latent_keeps_a_mistral_sliding_window():
    """Every layer sees its last 16 tokens: full rank reproduces the logits past the window, and decoding past it
    (the family's sliding cache keeps the last window of latents) equals recomputation."""
    model = build_tiny("mistral", VOCAB, num_key_value_heads=2, sliding_window=16)
    stats = calibration(model, "mistral")
    full = compressed(model, "mistral", stats, method="svdllm", targets="k,v", rank=64, kv_latent=True)
    assert logit_error(full, model, held_out()) < 1e-4  # 48 tokens, three windows
    half = compressed(model, "mistral", stats, method="svdllm", targets="k,v", ratio=0.5, kv_latent=True)
    assert greedy_decode_matches_recomputation(half, held_out()[:1, :8], 30)


def test_cli_bad_input_is_one_line_and_exit_2(tiny_checkpoints, tmp_path):
    out = tmp_path / "never"
    result = CliRunner().invoke(app, ["compress", str(tiny_checkpoints["llama-gqa"]), "--rank", "0", "-o", str(out)])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "--rank" in result.output
    assert not out.exists()


def test_cli_dry_run_prints_ranks_and_writes_nothing(tiny_checkpoints, tmp_path):
    result = CliRunner().invoke(app, ["compress", str(tiny_checkpoints["mistral"]), "--ratio", "0.5", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert record["written"] is None and record["plan"][0]["q"] == 16  # 0.5 * 64*64/128
    assert record["kept_fraction"] == pytest.approx(0.5, abs=0.02)


def test_input_statistics_accumulate_the_augmented_moment():
    stats = InputStatistics()
    x = torch.randn(3, 5, 4)
    stats.add(x[:2])
    stats.add(x[2:])
    xa = torch.cat([x.reshape(-1, 4), torch.ones(15, 1)], 1).double()
    assert torch.allclose(stats.sigma, xa.T @ xa / 15)
    assert torch.allclose(stats.abs_mean, x.reshape(-1, 4).abs().mean(0).double())


def test_static_cache_is_refused_with_a_reason():
    from transformers import StaticCache

    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    result = compressed(model, "llama", calibration(model, "llama"), method="svdllm", targets="k,v", ratio=0.5, kv_latent=True)
    cache = StaticCache(config=result.config, max_cache_len=32)
    with pytest.raises(ValueError, match="dynamic cache"), torch.no_grad():
        result(held_out()[:1, :8], cache=cache, use_cache=True)
