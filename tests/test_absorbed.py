"""The absorbed latent attention (modeling/absorbed.py) gives the stock DeepseekV3 path's logits, prefill and
decode, and never forms a per-head key or value for the context."""

import pytest
import torch
from transformers import DeepseekV3ForCausalLM, DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from attnsurg.arch import inspect_config
from attnsurg.methods.mla.assemble import deepseek_config
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.modeling.absorbed import AbsorbedMLAAttention, runtime_applies, use_runtime

from conftest import build_tiny

NEW_TOKENS = 64


def tiny_mla(family: str, fmt: str, layout: str, nope_width: str = "latent", interleave: bool = True,
             budget: float = 0.5) -> DeepseekV3ForCausalLM:
    """A random DeepseekV3 model with the config ``convert --to mla`` writes for a tiny source."""
    source = build_tiny(family, 384, num_key_value_heads=2)
    plan = plan_mla(inspect_config(source.config), kv_budget=budget, format=fmt, layout=layout, nope_width=nope_width)
    config = deepseek_config(source, plan, source.model.rotary_emb.inv_freq)
    config.rope_interleave = interleave
    torch.manual_seed(1)
    return DeepseekV3ForCausalLM(config).eval()


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 384, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    return ids, mask


def generated(model, runtime: str, ids, mask):
    use_runtime(model, runtime)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("family, fmt, layout, interleave", [
    ("llama", "native", "standard", True),
    ("llama", "exact", "flexible", True),
    ("qwen2", "exact", "standard", True),  # query biases: the q_a / q_b route
    ("qwen2", "native", "flexible", False),
    ("qwen3", "native", "standard", True),
])
@pytest.mark.parametrize("batch", [1, 2])
def test_absorbed_decode_gives_the_stock_logits(family, fmt, layout, interleave, batch):
    model = tiny_mla(family, fmt, layout, interleave=interleave)
    ids, mask = left_padded_batch()
    ids, mask = ids[-batch:], mask[-batch:]  # batch 1: the padded row alone
    stock = generated(model, "stock", ids, mask)
    absorbed = generated(model, "attnsurg", ids, mask)
    assert len(stock.logits) == len(absorbed.logits) == NEW_TOKENS
    error = max((a - b).abs().max().item() for a, b in zip(stock.logits, absorbed.logits))
    assert error < 1e-4
    assert torch.equal(stock.sequences, absorbed.sequences)


@pytest.mark.parametrize("nope_width", ["latent", "head"])
def test_a_prefill_in_two_chunks_and_single_steps_agree_with_stock(nope_width):
    """A second prefill on a filled cache (queries that are the last S of T positions) and plain steps."""
    model = tiny_mla("llama", "native", "standard", nope_width=nope_width)
    ids = torch.randint(0, 384, (1, 70), generator=torch.Generator().manual_seed(3))

    def chunked(runtime: str) -> list[torch.Tensor]:
        use_runtime(model, runtime)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            return [model(ids[:, a:b], cache=cache, use_cache=True).logits
                    for a, b in ((0, 30), (30, 60), (60, 61), (61, 70))]

    for stock, absorbed in zip(chunked("stock"), chunked("attnsurg")):
        assert (stock - absorbed).abs().max() < 1e-4


@pytest.mark.parametrize("length", [1, 2, 5, 16, 17, 30])
def test_a_short_prompt_alone_gives_the_stock_logits(length):
    """A prompt of a few tokens with no cache and no mask (a facts question, a chat turn): the plain-matmul
    path must be causal by itself, as SDPA's is_causal is on the longer one."""
    model = tiny_mla("llama", "native", "standard")
    ids = torch.randint(0, 384, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        use_runtime(model, "stock")
        stock = model(ids).logits
        use_runtime(model, "attnsurg")
        absorbed = model(ids).logits
    assert (stock - absorbed).abs().max() < 1e-4


def test_decode_never_expands_the_cached_latent(monkeypatch):
    """Neither stock's expansion nor kv_b_proj's forward runs: the up-projections act on queries and outputs."""
    model = tiny_mla("llama", "native", "standard")
    use_runtime(model, "attnsurg")

    def refuse(*args, **kwargs):
        raise AssertionError("per-head keys and values were formed from the cache")

    monkeypatch.setattr(DeepseekV3Attention, "expand_kv", refuse)
    for layer in model.model.layers:
        layer.self_attn.kv_b_proj.register_forward_hook(refuse)
    ids = torch.randint(0, 384, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)


def test_runtime_switches_each_attention_module_and_back():
    model = tiny_mla("llama", "native", "standard")
    layers = model.config.num_hidden_layers
    assert use_runtime(model, "attnsurg") == layers and use_runtime(model, "attnsurg") == 0
    assert all(type(layer.self_attn) is AbsorbedMLAAttention for layer in model.model.layers)
    assert use_runtime(model, "stock") == layers
    assert all(type(layer.self_attn) is DeepseekV3Attention for layer in model.model.layers)
    assert runtime_applies(model) and not runtime_applies(build_tiny("llama", 384))
    with pytest.raises(ValueError, match="runtime must be one of"):
        use_runtime(model, "fast")
