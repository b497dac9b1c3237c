"""Gemma 2 and 3: the projection methods factorize q, k, v and o inside the family's own attention; --kv-latent,
--stacked and Loki replace it with attnsurg's, which keeps the family's soft-capping, query scale, q/k norms,
sliding layers and per-type RoPE; MLA refuses with the reason. Analysis and the eval suite run on both."""

import json

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from attnsurg.cli import app
from attnsurg.io.load import load_model, resolve_source
from attnsurg.modeling.modeling_attnsurg import LokiAttention, StackedTuckerAttention

from helpers import remote_code_matches_attnsurg

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=384, pad_token_id=0, eos_token_id=0, bos_token_id=0, sliding_window=24)
CONFIGS = {"gemma2": lambda: Gemma2Config(**SMALL, query_pre_attn_scalar=20, attn_logit_softcapping=3.0),
           "gemma3": lambda: Gemma3TextConfig(**SMALL, layer_types=["sliding_attention", "full_attention"])}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma_checkpoint(request, tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(-0.5, 1.0)  # Gemma's norms scale by 1 + weight
    path = tmp_path_factory.mktemp(request.param) / "tiny"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def compressed(checkpoint, corpus_file, out, *args):
    return CliRunner().invoke(app, ["compress", str(checkpoint), *args, "--calib-text", str(corpus_file), "--calib-tokens",
                                    "512", "--calib-seq-len", "64", "--eval-tokens", "0", "-o", str(out)])


@pytest.mark.parametrize("args", [["--method", "svdllm", "--targets", "q,o", "--rank", "64"],
                                  ["--method", "asvd", "--targets", "k,v", "--rank", "32"],
                                  ["--method", "tucker", "--targets", "q", "--ranks", "4,16,64"],
                                  ["--method", "svdllm", "--targets", "k,v", "--kv-latent", "--rank", "64"],
                                  ["--method", "tucker", "--stacked", "--ranks", "16,64"]],
                         ids=["svdllm-q,o", "asvd-k,v", "tucker-q", "kv-latent", "stacked"])
def test_full_budget_reproduces_the_logits_beyond_the_sliding_window(gemma_checkpoint, corpus_file, tmp_path, args):
    result = compressed(gemma_checkpoint, corpus_file, tmp_path / "out", *args)
    assert result.exit_code == 0, result.output
    ids = torch.randint(0, 384, (1, 48), generator=torch.Generator().manual_seed(2))  # 48 > the window of 24
    with torch.no_grad():
        written = load_model(resolve_source(str(tmp_path / "out")))(ids).logits
        torch.testing.assert_close(written, load_model(resolve_source(str(gemma_checkpoint)))(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_compressed_gemma_loads_alike_with_remote_code(gemma_checkpoint, corpus_file, tmp_path):
    result = compressed(gemma_checkpoint, corpus_file, tmp_path / "out", "--method", "svdllm", "--ratio", "0.5")
    assert result.exit_code == 0, result.output
    assert remote_code_matches_attnsurg(tmp_path / "out", tmp_path)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_mla_refuses_gemma_even_without_sliding_layers(family):
    """MLA writes Llama-like DeepseekV3 layers around its attention: Gemma's is not one of them, windows or not."""
    from dataclasses import replace

    from attnsurg.arch import inspect_config
    from attnsurg.methods import registered_methods

    anatomy = replace(inspect_config(CONFIGS[family]()), sliding_window=None, sliding_layers=0)
    assert registered_methods()["mla"].unsupported_reason(anatomy).startswith("MLA writes Llama-like DeepseekV3 decoder layers")


def test_loki_at_full_budget_reproduces_the_logits_beyond_the_sliding_window(gemma_checkpoint, corpus_file, tmp_path):
    """Rank = head dim and every key: Loki's own attention (query scale, soft-capping, q/k norms, windows) is the
    family's."""
    result = compressed(gemma_checkpoint, corpus_file, tmp_path / "out", "--method", "loki", "--rank", "16", "--top-k", "1.0")
    assert result.exit_code == 0, result.output
    ids = torch.randint(0, 384, (2, 56), generator=torch.Generator().manual_seed(3))  # 56 > the window of 24
    loki = load_model(resolve_source(str(tmp_path / "out")))
    assert any(isinstance(m, LokiAttention) and m.sliding_window == 24 for m in loki.modules())
    with torch.no_grad():
        torch.testing.assert_close(loki(ids).logits, load_model(resolve_source(str(gemma_checkpoint)))(ids).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("args", [["--method", "loki", "--rank", "6", "--top-k", "0.25"],
                                  ["--method", "svdllm", "--targets", "k,v", "--kv-latent", "--ratio", "0.5"],
                                  ["--method", "tucker", "--stacked", "--ratio", "0.5"]], ids=["loki", "kv-latent", "stacked"])
def test_replaced_attention_decodes_past_the_window_as_it_recomputes(gemma_checkpoint, corpus_file, tmp_path, args):
    """Generate (the family's sliding cache, which keeps the last window of whatever the attention caches) gives
    the logits that recomputing every prefix gives, well past the window."""
    result = compressed(gemma_checkpoint, corpus_file, tmp_path / "out", *args)
    assert result.exit_code == 0, result.output
    model = load_model(resolve_source(str(tmp_path / "out")))
    if "--stacked" in args:  # the shared hidden coordinates are what the sliding cache holds
        assert all(m.cache_latent for m in model.modules() if isinstance(m, StackedTuckerAttention))
    prompt = torch.randint(0, 384, (1, 10), generator=torch.Generator().manual_seed(4))
    generated = model.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False, eos_token_id=None,
                               output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        recomputed = model(generated.sequences[:, :-1], use_cache=False).logits[:, prompt.shape[1] - 1:]
    torch.testing.assert_close(torch.stack(generated.logits, dim=1), recomputed, rtol=1e-4, atol=1e-4)


def test_loki_selects_only_inside_a_sliding_layers_window(gemma_checkpoint, corpus_file, tmp_path):
    result = compressed(gemma_checkpoint, corpus_file, tmp_path / "out", "--method", "loki", "--rank", "6", "--top-k", "0.25")
    assert result.exit_code == 0, result.output
    attention = next(m for m in load_model(resolve_source(str(tmp_path / "out"))).modules()
                     if isinstance(m, LokiAttention) and m.sliding_window)
    length, window = 60, attention.sliding_window
    query, key = torch.randn(2, 1, 4, length, 16).unbind(0)
    selected = attention.selection(query, key, None)[0, 0]  # [T, S]
    positions = torch.arange(length)
    allowed = (positions[None] <= positions[:, None]) & (positions[None] > positions[:, None] - window)
    assert not (selected & ~allowed).any() and selected[positions, positions].all()
    expected = torch.ceil(allowed.sum(-1).double() * 0.25).long()
    assert torch.equal(selected.sum(-1), expected)


def test_analysis_scores_each_layers_own_attention(gemma_checkpoint):
    """What analyze and plan score (queries and keys through the q/k norms and the layer type's RoPE, the query
    scale, soft-capping, the sliding window) is what the model attends with, in sliding and global layers."""
    from attnsurg.heads import attention_probabilities, head_projections, layer_masking
    from attnsurg.arch.families import family_for_surgery

    model = load_model(resolve_source(str(gemma_checkpoint)))
    model.config._attn_implementation = "eager"
    family = family_for_surgery(model.config.model_type)
    ids = torch.randint(0, 384, (1, 40), generator=torch.Generator().manual_seed(0))  # past the window of 24
    hidden = {}
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda m, a, kw, i=index: hidden.update({i: kw["hidden_states"]}),
                                                  with_kwargs=True)
    with torch.no_grad():
        expected = model(ids, output_attentions=True).attentions
        for index, layer in enumerate(model.model.layers):
            attention = layer.self_attn
            rope = family.layer_rotary(model, index)(hidden[index], torch.arange(40)[None])
            _, _, _, query, key = head_projections(attention, hidden[index], rope)
            probabilities = attention_probabilities(query, key.repeat_interleave(2, dim=0), attention.scaling,
                                                    **layer_masking(attention))
            torch.testing.assert_close(probabilities, expected[index][0], rtol=1e-5, atol=1e-6)


def test_analyze_and_plan_run_on_gemma_and_mla_is_refused_before_loading(gemma_checkpoint, corpus_file, tmp_path):
    report = CliRunner().invoke(app, ["analyze", str(gemma_checkpoint), "--text", str(corpus_file), "--tokens", "256",
                                      "--seq-len", "64", "-o", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output
    calibration = ["--calib-text", str(corpus_file), "--calib-tokens", "256", "--calib-seq-len", "64", "--eval-tokens", "128",
                   "--eval-domains", "none", "--target-ratio", "2"]
    plan = CliRunner().invoke(app, ["analyze", "plan", str(gemma_checkpoint), "--methods", "loki-variance,svdllm",
                                    *calibration, "-o", str(tmp_path / "plan")])
    assert plan.exit_code == 0, plan.output
    refused = CliRunner().invoke(app, ["analyze", "plan", str(gemma_checkpoint), "--methods", "svdllm,mla", *calibration,
                                       "-o", str(tmp_path / "never")])
    assert refused.exit_code == 2 and "cannot plan mla" in refused.output and not (tmp_path / "never").exists()


def test_the_eval_suite_runs_on_gemma_and_its_loki_result(gemma_checkpoint, corpus_file, tmp_path):
    loki = tmp_path / "loki"
    assert compressed(gemma_checkpoint, corpus_file, loki, "--method", "loki", "--rank", "8", "--top-k", "0.25").exit_code == 0
    models = [str(gemma_checkpoint), str(loki)]
    runner = CliRunner()
    perplexity = runner.invoke(app, ["eval", "perplexity", *models, "--dataset", "wiki-sample,c4-sample", "--seq-len", "64",
                                     "--tokens", "128", "--json"])
    assert perplexity.exit_code == 0, perplexity.output
    assert len(json.loads(perplexity.stdout)["results"]) == 4
    tasks = runner.invoke(app, ["eval", "tasks", *models, "--limit", "4", "--passkey-lengths", "64", "--json"])
    assert tasks.exit_code == 0, tasks.output
    speed = runner.invoke(app, ["eval", "speed", *models, "--context", "48", "--new-tokens", "2", "--repeats", "1",
                                "--warmup", "0", "--device", "cpu", "--json"])
    assert speed.exit_code == 0, speed.output
    for model in json.loads(speed.stdout)["models"]:  # sliding layers hold only their window: less than the config's
        (context,) = model["contexts"]
        assert 0 < context["kv_bytes_per_token"] < model["predicted_kv_bytes_per_token"]


@pytest.mark.parametrize("args", [["--method", "svdllm", "--targets", "q,k,v,o", "--ratio", "0.5"],
                                  ["--method", "loki", "--rank", "6", "--top-k", "0.25"],
                                  ["--method", "tucker", "--stacked", "--ratio", "0.5"]], ids=["svdllm", "loki", "stacked"])
def test_streamed_compression_equals_the_loaded_one(gemma_checkpoint, corpus_file, tmp_path, args):
    """One decoder layer in memory at a time: the stream starts at the scaled embeddings and each layer runs with its
    type's RoPE and window, so the statistics, the tensors written and the scores are the loaded run's."""
    reports = {}
    for name, extra in (("loaded", ["--no-stream"]), ("streamed", ["--stream"])):
        result = CliRunner().invoke(app, ["compress", str(gemma_checkpoint), *args, "--calib-text", str(corpus_file),
                                          "--calib-tokens", "512", "--calib-seq-len", "64", "--eval-tokens", "128",
                                          "--eval-domains", "none", "--json", *extra, "-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        reports[name] = json.loads(result.stdout)
        assert reports[name]["streamed"] == (name == "streamed")
    for score in ("ppl_before", "ppl_after"):
        assert reports["streamed"][score] == pytest.approx(reports["loaded"][score], rel=1e-4)
    loaded, streamed = (load_model(resolve_source(str(tmp_path / name))) for name in ("loaded", "streamed"))
    ids = torch.randint(0, 384, (1, 56), generator=torch.Generator().manual_seed(5))  # 56 > the window of 24
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, loaded(ids).logits, rtol=1e-4, atol=1e-4)
