import json

import pytest
import torch
from typer.testing import CliRunner

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.cli import app
from attnsurg.errors import UserError
from attnsurg.io.load import load_model, resolve_source
from attnsurg.methods.base import operate_loaded
from attnsurg.methods.loki import parse_top_k, plan_loki, top_k_recall

from conftest import build_tiny, greedy_decode_matches_recomputation
from helpers import VOCAB, calibration, held_out, logit_error


def loki_model(model, family: str, rank: int | None, top_k, basis: str = "post-rope", variance: float | None = None):
    plan = plan_loki(inspect_config(model.config), rank, top_k, basis, variance)
    return operate_loaded(model, family_for_surgery(family), calibration(model, family), plan, 64).model


def layer_ranks(model) -> list[int]:
    return [layer.self_attn.rank for layer in model.model.layers]


def test_explained_variance_picks_per_layer_ranks_that_grow_with_the_threshold():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    ranks = [layer_ranks(loki_model(model, "llama", None, 0.25, variance=v)) for v in (0.5, 0.8, 0.95)]
    assert all(a <= b for low, high in zip(ranks, ranks[1:]) for a, b in zip(low, high))
    assert ranks[0] != ranks[2] and all(1 <= r < 16 for r in ranks[1])
    windows = held_out(5)
    recalls = [top_k_recall(loki_model(model, "llama", None, 0.25, variance=v), windows) for v in (0.5, 0.95)]
    assert recalls[0] < recalls[1]
    full = loki_model(model, "llama", None, 1.0, variance=1.0)
    assert layer_ranks(full) == [16, 16] and logit_error(full, model, held_out()) < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("top_k", [1.0, 1000])
def test_full_rank_and_every_key_reproduce_the_logits(family, top_k):
    model = build_tiny(family, VOCAB, num_key_value_heads=2)
    assert logit_error(loki_model(model, family, 16, top_k), model, held_out()) < 1e-4


def test_error_falls_as_rank_and_top_k_grow():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    by_k = [logit_error(loki_model(model, "llama", 8, k), model, held_out(), "mse") for k in (0.125, 0.25, 0.5)]
    by_rank = [logit_error(loki_model(model, "llama", r, 0.25), model, held_out(), "mse") for r in (2, 8, 16)]
    assert by_k[0] > by_k[1] > by_k[2]
    assert by_rank[0] > by_rank[1] > by_rank[2]


def test_recall_grows_with_rank_and_is_complete_at_full_rank():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    windows = held_out(5)
    recalls = [top_k_recall(loki_model(model, "llama", r, 0.25), windows) for r in (2, 8, 16)]
    assert recalls[0] < recalls[1] < recalls[2] == pytest.approx(1.0)


def test_post_rope_basis_is_orthonormal_and_differs_from_pre_rope():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    post = loki_model(model, "llama", 4, 0.25).model.layers[0].self_attn.loki_basis
    pre = loki_model(model, "llama", 4, 0.25, "pre-rope").model.layers[0].self_attn.loki_basis
    eye = torch.eye(16).expand(2, -1, -1)
    assert torch.allclose(post.transpose(1, 2) @ post, eye, atol=1e-5)
    assert not torch.allclose(post.abs(), pre.abs(), atol=1e-2)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_decode_with_the_cache_matches_prefill_recomputation(family):
    model = loki_model(build_tiny(family, VOCAB, num_key_value_heads=2), family, 4, 8)
    assert greedy_decode_matches_recomputation(model, held_out()[:1, :8], 20)


def test_a_mistral_sliding_window_is_kept():
    """Every layer sees its last 16 tokens: full rank and every key reproduce the logits past the window, and a
    top quarter decodes past it as it recomputes."""
    model = build_tiny("mistral", VOCAB, num_key_value_heads=2, sliding_window=16)
    assert logit_error(loki_model(model, "mistral", 16, 1.0), model, held_out()) < 1e-4
    assert greedy_decode_matches_recomputation(loki_model(model, "mistral", 4, 0.25), held_out()[:1, :8], 30)


@pytest.mark.parametrize(
    "rank, top_k, fragment",
    [(0, 0.25, "--rank"), (17, 0.25, "--rank"), (4, 0, "--top-k"), (4, 1.5, "--top-k"), (4, None, "--top-k")],
)
def test_bad_rank_and_top_k(rank, top_k, fragment):
    anatomy = inspect_config(build_tiny("llama", VOCAB, num_key_value_heads=2).config)
    with pytest.raises(UserError, match=fragment):
        plan_loki(anatomy, rank, top_k)


def test_top_k_parsing():
    assert parse_top_k("64") == 64 and parse_top_k("0.25") == 0.25 and parse_top_k("1/8") == 0.125
    with pytest.raises(UserError, match="--top-k"):
        parse_top_k("a quarter")


def compress_loki(checkpoint, corpus_file, out, *options: str) -> dict:
    """``attnsurg compress --method loki`` on a tiny checkpoint with ``options``; its JSON record."""
    args = ["compress", str(checkpoint), "--method", "loki", *options, "--calib-text", str(corpus_file),
            "--calib-tokens", "512", "-o", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cli_writes_a_checkpoint_that_reloads_equal(tiny_checkpoints, corpus_file, tmp_path):
    out = tmp_path / "loki"
    record = compress_loki(tiny_checkpoints["llama-gqa"], corpus_file, out, "--rank", "4", "--top-k", "1/4", "--eval-tokens", "256",
                            "--eval-domains", "none")
    assert record["rank"] == 4 and record["top_k"] == 0.25 and record["ppl_after"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["attnsurg"]["loki"] == {"rank": 4, "top_k": 0.25, "basis": "post-rope"}
    bad = CliRunner().invoke(app, ["compress", str(tiny_checkpoints["llama-gqa"]), "--method", "loki", "--rank", "99",
                                   "--top-k", "8", "-o", str(tmp_path / "never")])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1 and not (tmp_path / "never").exists()
    evaluated = CliRunner().invoke(app, ["eval", "perplexity", str(tiny_checkpoints["llama-gqa"]), str(out), "--text",
                                         str(corpus_file), "--max-length", "64", "--max-tokens", "256", "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    original, loki = json.loads(evaluated.stdout)["results"]
    assert original["top_k_recall"] is None and original["surgery"] is None
    assert loki["surgery"] == "loki: rank 4 of head dim 16, top-k 0.25 of each query's context, post-rope basis"
    assert 0 < loki["top_k_recall"] < 1
    table = CliRunner().invoke(app, ["eval", "perplexity", str(out), "--text", str(corpus_file), "--max-length", "64",
                                     "--max-tokens", "128"])
    assert "top-k recall" in table.output


def test_cli_variance_writes_per_layer_ranks_that_reload(tiny_checkpoints, corpus_file, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "loki"
    record = compress_loki(tiny_checkpoints["llama-gqa"], corpus_file, out, "--variance", "0.9", "--top-k", "16", "--eval-tokens", "0")
    config = json.loads((out / "config.json").read_text())["attnsurg"]["loki"]
    assert config["rank"] == record["ranks"] and len(config["rank"]) == 2 and config["variance"] == 0.9
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert [layer.self_attn.rank for layer in reloaded.model.layers] == config["rank"]
    for extra, fragment in ((["--rank", "4"], "not both"), ([], "--variance: Input should be less than or equal to 1")):
        bad_args = ["compress", str(tiny_checkpoints["llama-gqa"]), "--method", "loki", "--top-k", "16", "-o",
                    str(tmp_path / "never"), *extra, "--variance", "0.9" if extra else "1.5"]
        bad = CliRunner().invoke(app, bad_args)
        assert bad.exit_code == 2 and fragment in bad.output and not (tmp_path / "never").exists()


def test_reload_equals_in_memory(tiny_checkpoints, tmp_path):
    from attnsurg.io.card import CardInfo
    from attnsurg.io.save import write_checkpoint

    source = load_model(resolve_source(str(tiny_checkpoints["mistral"])))
    model = loki_model(source, "mistral", 6, 16)
    write_checkpoint(model, None, tmp_path / "out", CardInfo(title="t", summary="s"))
    assert logit_error(model, load_model(resolve_source(str(tmp_path / "out"))), held_out()) == 0.0


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_left_padding_changes_nothing(implementation):
    """Padded keys are neither attended nor counted in a query's context or its top-k."""
    model = loki_model(build_tiny("llama", VOCAB, num_key_value_heads=2), "llama", 4, 3)
    model.config._attn_implementation = implementation
    ids = held_out()[:1, :10]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        alone = model(ids).logits[:, -1]
        with_padding = model(padded, attention_mask=mask, position_ids=positions).logits[:, -1]
    assert torch.isfinite(with_padding).all()
    torch.testing.assert_close(with_padding, alone, atol=1e-4, rtol=1e-4)


def test_decode_step_gathers_the_same_keys_as_the_general_path():
    """The one-token fast path (top-k gather from the cache) equals the masked general path."""
    from transformers import DynamicCache

    from attnsurg.modeling.modeling_attnsurg import LokiAttention

    model = loki_model(build_tiny("llama", VOCAB, num_key_value_heads=2), "llama", 4, 5)
    ids = held_out()[:1, :24]

    def last_logits(general: bool) -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :-1], cache=cache, use_cache=True)
            for attention in model.modules():
                if isinstance(attention, LokiAttention):
                    attention.recall = [] if general else None  # recording recall forces the general path
            logits = model(ids[:, -1:], cache=cache, use_cache=True).logits[:, -1]
        for attention in model.modules():
            if isinstance(attention, LokiAttention):
                attention.recall = None
        return logits

    torch.testing.assert_close(last_logits(general=False), last_logits(general=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [5, 0.3])
def test_query_blocks_change_nothing(monkeypatch, top_k):
    """Prefill scored a few queries at a time (each block against the keys it may see) equals one block,
    recall included, with and without left padding."""
    import attnsurg.modeling.modeling_attnsurg as modeling

    model = loki_model(build_tiny("llama", VOCAB, num_key_value_heads=2), "llama", 4, top_k)
    ids = held_out()[:2, :40]
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)

    def logits_and_recall(block: int) -> tuple[torch.Tensor, float]:
        monkeypatch.setattr(modeling, "LOKI_QUERY_BLOCK", block)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, position_ids=positions).logits
        return logits, top_k_recall(model, ids[:1])

    whole_logits, whole_recall = logits_and_recall(10**6)
    blocked_logits, blocked_recall = logits_and_recall(3)
    torch.testing.assert_close(blocked_logits, whole_logits, atol=1e-5, rtol=1e-5)
    assert blocked_recall == pytest.approx(whole_recall)
