import torch

from attnsurg.arch.families import SURGERY_FAMILIES
from attnsurg.calibrate import InputStatistics
from attnsurg.methods.consumers import LayerContext, distance_offsets, output_gain, rotation_average
from attnsurg.methods.lowrank import Unit, decompose


def test_rotation_average_matches_brute_force():
    torch.manual_seed(0)
    d = 8
    A = torch.randn(d, d, dtype=torch.float64)
    Q = A @ A.T
    inv_freq = 1.0 / (100 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    offsets, weights = distance_offsets(16)
    expected = torch.zeros(d, d, dtype=torch.float64)
    for o, w in zip(-offsets, weights):
        c, s = torch.cos(o * inv_freq).repeat(2), torch.sin(o * inv_freq).repeat(2)
        J = torch.zeros(d, d, dtype=torch.float64)
        J[: d // 2, d // 2 :], J[d // 2 :, : d // 2] = -torch.eye(d // 2), torch.eye(d // 2)
        R = torch.diag(c) + torch.diag(s) @ J
        expected += w * R.T @ Q @ R
    expected /= weights.sum()
    assert torch.allclose(rotation_average(Q, inv_freq, -offsets, weights), expected, atol=1e-12)


def output_context(gain: torch.Tensor | None, hidden: int = 32, heads: int = 4, head_dim: int = 8) -> LayerContext:
    torch.manual_seed(0)
    attn = torch.nn.Module()
    attn.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=False)
    o, x = InputStatistics(), InputStatistics()
    o.add(torch.randn(4, 64, heads * head_dim) * torch.logspace(0, -1, heads * head_dim))
    x.add(torch.randn(4, 64, hidden))
    return LayerContext(attn, x, o, torch.ones(head_dim // 2), heads, heads, 64, gain)


def test_a_norm_on_the_attention_output_weights_values_and_o_by_its_gain():
    """Gemma normalises the attention's output before the residual add: an error in dim i of o_proj's output
    reaches the stream times g_i, so the fit is Eckart-Young under diag(g^2) and beats the plain fit there."""
    gain = torch.logspace(1.5, -1, 32, dtype=torch.float64)[torch.randperm(32, generator=torch.Generator().manual_seed(1))]
    weighted, plain = output_context(gain), output_context(None)
    Wo = weighted.attn.o_proj.weight.detach().double()
    per_head = [Wo[:, h * 8 : (h + 1) * 8] for h in range(4)]
    torch.testing.assert_close(weighted.value_weight(), torch.block_diag(*[W.T @ torch.diag(gain.square()) @ W for W in per_head]))
    assert plain.output_weight() is None
    unit = Unit(0, "o", 32, 32)

    def gained_error(ctx: LayerContext) -> float:
        down, up = decompose(unit, ctx, "svdllm", weighted=True).factors(8)
        D = Wo - up @ down
        return float(torch.trace(gain[:, None] * D @ weighted.o.sigma[:-1, :-1] @ D.T * gain[:, None]))

    assert gained_error(weighted) < 0.8 * gained_error(plain)


def test_the_output_gain_is_gemmas_post_attention_norm_and_none_for_llama():
    from transformers import Gemma3TextConfig, LlamaConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=8)
    gemma = Gemma3DecoderLayer(Gemma3TextConfig(**small, layer_types=["full_attention"]), 0)
    with torch.no_grad():
        gemma.post_attention_layernorm.weight.copy_(torch.linspace(-1, 3, 16))
    torch.testing.assert_close(output_gain(gemma, SURGERY_FAMILIES["gemma3_text"]), 1 + torch.linspace(-1, 3, 16, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert output_gain(LlamaDecoderLayer(LlamaConfig(**small), 0), SURGERY_FAMILIES["llama"]) is None
