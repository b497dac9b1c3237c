"""heads: a source attention layer recomputed from its input is the layer's own attention."""

import pytest
import torch

from attnsurg.calibrate import InputStatistics, augment, input_statistics
from attnsurg.heads import attention_probabilities, head_projections, received_attention

from conftest import build_tiny


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_captured_queries_and_keys_give_the_models_own_attention(family):
    """What the analyser scores (its queries and keys, after q/k norms and RoPE) is the model's attention."""
    model = build_tiny(family, 384, num_key_value_heads=2)
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    captured = {}
    model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(hidden=kwargs["hidden_states"], rope=kwargs["position_embeddings"]),
        with_kwargs=True)
    with torch.no_grad():
        expected = model(ids, output_attentions=True).attentions[1][0]
        _, _, _, query, key = head_projections(model.model.layers[1].self_attn, captured["hidden"], captured["rope"])
    probabilities = attention_probabilities(query, key.repeat_interleave(2, dim=0), 16 ** -0.5)
    torch.testing.assert_close(probabilities, expected, rtol=1e-5, atol=1e-6)


def hooked_attention(model, layer: int, ids: torch.Tensor):
    """The model's own attention probabilities at ``layer`` (eager) and what that layer's attention was called with."""
    model.config._attn_implementation = "eager"
    captured = {}
    handle = model.model.layers[layer].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(hidden=kwargs["hidden_states"], rope=kwargs["position_embeddings"]),
        with_kwargs=True)
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions[layer]
    handle.remove()
    return attentions, captured


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_received_attention_is_the_models_attention_summed_over_queries_and_averaged_over_heads(family):
    model = build_tiny(family, 384, num_key_value_heads=2)
    ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    expected, captured = hooked_attention(model, 1, ids)
    received = received_attention(model.model.layers[1].self_attn, captured["hidden"], captured["rope"])
    torch.testing.assert_close(received, expected.sum(dim=2).mean(dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(received.mean(dim=1), torch.ones(1))  # every query hands out one unit


def test_statistics_weighed_by_received_attention_are_the_weighted_moment():
    model = build_tiny("llama", 384, num_key_value_heads=2)
    windows = torch.randint(0, 384, (3, 20), generator=torch.Generator().manual_seed(0))
    attentions = [layer.self_attn for layer in model.model.layers]
    stats = input_statistics(model, attentions, windows, received=attentions[1:])
    assert stats[0].sigma_received is None
    expected = InputStatistics()
    for window in windows:
        weights, captured = hooked_attention(model, 1, window[None])
        x = augment(captured["hidden"]).double()
        expected.add(captured["hidden"])
        received = weights.sum(dim=2).mean(dim=1).reshape(-1, 1).double()
        expected.received_moment = (x * received).T @ x + (0 if expected.received_moment is None else expected.received_moment)
    torch.testing.assert_close(stats[1].sigma, expected.sigma)
    torch.testing.assert_close(stats[1].sigma_received, expected.sigma_received, rtol=1e-5, atol=1e-6)


def test_uniform_received_attention_gives_the_plain_moment():
    x = torch.randn(2, 16, 8)
    stats = InputStatistics()
    stats.add(x, torch.ones(2, 16))
    torch.testing.assert_close(stats.sigma_received, stats.sigma)
