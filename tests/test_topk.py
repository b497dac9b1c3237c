import json

import pytest
from typer.testing import CliRunner

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.cli import app
from attnsurg.errors import UserError
from attnsurg.io.load import load_model, resolve_source
from attnsurg.methods.base import method_for, operate_loaded
from attnsurg.methods.loki import plan_loki
from attnsurg.methods.topk import TopKSettings, plan_topk

from conftest import build_tiny
from helpers import VOCAB, calibration, held_out, logit_error


def topk_model(model, family: str, top_k):
    """``compress --method topk`` on a loaded model (its statistics go unread)."""
    plan = method_for(TopKSettings(top_k=top_k)).plan(inspect_config(model.config), TopKSettings(top_k=top_k))
    return operate_loaded(model, family_for_surgery(family), calibration(model, family), plan, 64).model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("top_k", [1.0, 1000])
def test_every_key_kept_reproduces_the_logits(family, top_k):
    model = build_tiny(family, VOCAB, num_key_value_heads=2)
    assert logit_error(topk_model(model, family, top_k), model, held_out()) < 1e-4


def test_error_falls_as_more_keys_are_kept():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    errors = [logit_error(topk_model(model, "llama", k), model, held_out(), "mse") for k in (0.125, 0.25, 0.5, 1.0)]
    assert errors[0] > errors[1] > errors[2] > errors[3] and errors[3] < 1e-10


def test_it_is_loki_at_full_rank():
    """Exact scores select what Loki's full-rank PCA scores select: the two models agree."""
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    plan = plan_loki(inspect_config(model.config), 16, 0.25)
    loki = operate_loaded(model, family_for_surgery("llama"), calibration(model, "llama"), plan, 64).model
    assert logit_error(topk_model(model, "llama", 0.25), loki, held_out()) < 1e-4


@pytest.mark.parametrize("top_k, fragment", [(None, "--top-k must be"), (0, "--top-k must be"), (1.5, "--top-k must be")])
def test_bad_top_k(top_k, fragment):
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    with pytest.raises(UserError, match=fragment):
        plan_topk(inspect_config(model.config), top_k)


def test_cli_writes_a_checkpoint_that_reloads_equal(tiny_checkpoints, corpus_file, tmp_path):
    out = tmp_path / "topk"
    args = ["compress", str(tiny_checkpoints["llama-gqa"]), "--method", "topk", "--top-k", "1/4", "--calib-text",
            str(corpus_file), "--calib-tokens", "512", "--eval-tokens", "256", "--eval-domains", "none", "-o", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["top_k"] == 0.25 and record["ppl_after"] > record["ppl_before"] * 0.5
    assert json.loads((out / "config.json").read_text())["attnsurg"]["loki"] == {"rank": 16, "top_k": 0.25, "basis": "post-rope"}
    source = load_model(resolve_source(str(tiny_checkpoints["llama-gqa"])))
    assert logit_error(topk_model(source, "llama", 0.25), load_model(resolve_source(str(out))), held_out()) < 1e-5
    for extra, fragment in ((["--rank", "4"], "--rank does not apply to --method topk"), (["--top-k", "x"], "--top-k: expects")):
        bad = CliRunner().invoke(app, ["compress", str(tiny_checkpoints["llama-gqa"]), "--method", "topk", "--top-k", "8",
                                       *extra, "-o", str(tmp_path / "never")])
        assert bad.exit_code == 2 and fragment in bad.output and not (tmp_path / "never").exists()
