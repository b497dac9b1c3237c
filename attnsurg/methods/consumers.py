"""Consumer weights: what consumes each attention projection's output, from one layer's calibration statistics.

An error e in a key changes a score by q^T R_{-delta} e, where R_delta is the RoPE rotation over the query-key
distance, so the key weight is E_delta[R^T Q R] with Q the second moment of the queries of that key head
(averaged over the distances of the calibration windows, each weighted by how many query-key pairs have it);
symmetrically the key moment weights queries, and W_o^T W_o (per head group) weights values. Used by the
low-rank, head-tensor and stacked Tucker fits, by Loki's key bases and by MLA's q/k norms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from attnsurg.arch.families import Family
from attnsurg.calibrate import InputStatistics
from attnsurg.linalg import augmented

PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}  # a unit's name -> its module in the attention


def distance_offsets(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query-key distances 0..length-1 in a causal window and how many pairs have each."""
    delta = torch.arange(length, dtype=torch.float64)
    return delta, length - delta


def rotation_average(Q: torch.Tensor, inv_freq: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """E_o[R_o^T Q R_o] for the half-split RoPE rotation R_o = diag(c) + diag(s) J (c, s: cos/sin of o * freq,
    J x = rotate_half(x)), averaged over offsets o with the given weights, in O(d^2 * len(offsets)):
    E[diag(u) Q diag(v)] = Q * E[u v^T] elementwise."""
    angles = offsets[:, None] * inv_freq.double()[None]
    c, s = torch.cos(angles).repeat(1, 2), torch.sin(angles).repeat(1, 2)  # [n, d]
    w = (weights / weights.sum())[:, None]
    cc, cs, ss = (w * c).T @ c, (w * c).T @ s, (w * s).T @ s
    h = Q.shape[0] // 2
    J = torch.zeros_like(Q)
    J[:h, h:], J[h:, :h] = -torch.eye(h, dtype=Q.dtype), torch.eye(h, dtype=Q.dtype)
    return Q * cc + (Q * cs) @ J + J.T @ (Q * cs.T) + J.T @ (Q * ss) @ J


def head_moments(weight: torch.Tensor, bias: torch.Tensor | None, sigma: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """Per head, the second moment of its (pre-RoPE) output on the calibration inputs."""
    Wa = augmented(weight, bias)
    d = Wa.shape[0] // heads
    return [Wa[h * d : (h + 1) * d] @ sigma @ Wa[h * d : (h + 1) * d].T for h in range(heads)]


def norm_scale(attn, projection: str) -> torch.Tensor | None:
    """The per-dimension gain of the attention's RMSNorm on each query or key head (``q_norm``/``k_norm``:
    Qwen3's weight, Gemma 3's 1 + weight), or None where the family has none: the norm of a vector of ones,
    whose RMS is one."""
    norm = getattr(attn, f"{projection}_norm", None)
    if norm is None:
        return None
    with torch.no_grad():
        return norm(torch.ones(1, norm.weight.shape[-1], dtype=norm.weight.dtype, device=norm.weight.device))[0].double().cpu()


def attention_moments(attn, projection: str, sigma: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """Per head, the second moment of the queries or keys attention scores with (before RoPE). Through a
    q/k RMSNorm n(y) = g * y / rms(y) it is linearised at the head's mean square:
    E[n(y) n(y)^T] ~ diag(g) E[y y^T] diag(g) / E[rms(y)^2] (exact when every token's rms is the same)."""
    linear = getattr(attn, f"{projection}_proj")
    moments = head_moments(linear.weight, linear.bias, sigma, heads)
    gain = norm_scale(attn, projection)
    if gain is None:
        return moments
    return [gain[:, None] * M * gain[None] / (M.trace() / M.shape[0]).clamp_min(1e-30) for M in moments]


def through_norm_jacobian(weight: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
    """A consumer weight on a q/k norm's output pulled back to its input: J^T W J with J ~ diag(g) / rms (the
    norm's Jacobian without its radial part; the scale 1/rms is left out, each block is rescaled anyway)."""
    return weight if gain is None else gain[:, None] * weight * gain[None]


def block_diagonal(blocks: list[torch.Tensor]) -> torch.Tensor:
    return torch.block_diag(*blocks)


@dataclass
class LayerContext:
    """What the consumer weights of one layer need."""

    attn: torch.nn.Module
    x: InputStatistics  # attention input
    o: InputStatistics  # o_proj input
    inv_freq: torch.Tensor
    heads: int
    kv_heads: int
    seq_len: int

    def key_weight(self) -> torch.Tensor:
        """Gd x Gd: per KV head, the rotation-averaged second moment of the queries that read it (through
        the key norm's Jacobian where the family has q/k norms)."""
        q = attention_moments(self.attn, "q", self.x.sigma, self.heads)
        delta, w = distance_offsets(self.seq_len)
        per_group = self.heads // self.kv_heads
        return block_diagonal([
            through_norm_jacobian(rotation_average(sum(q[g * per_group : (g + 1) * per_group]), self.inv_freq, -delta, w),
                                  norm_scale(self.attn, "k"))
            for g in range(self.kv_heads)
        ])

    def query_weight(self) -> torch.Tensor:
        """Hd x Hd: per head, the rotation-averaged second moment of the keys it reads (through the query
        norm's Jacobian where the family has q/k norms)."""
        k = attention_moments(self.attn, "k", self.x.sigma, self.kv_heads)
        delta, w = distance_offsets(self.seq_len)
        per_group = self.heads // self.kv_heads
        averaged = [through_norm_jacobian(rotation_average(k_g, self.inv_freq, delta, w), norm_scale(self.attn, "q"))
                    for k_g in k]
        return block_diagonal([averaged[h // per_group] for h in range(self.heads)])

    def value_weight(self) -> torch.Tensor:
        """Gd x Gd: per KV head, the sum of W_o,h^T W_o,h over the heads that read it."""
        Wo = self.attn.o_proj.weight.double()
        d = Wo.shape[1] // self.heads
        per_group = self.heads // self.kv_heads
        blocks = []
        for g in range(self.kv_heads):
            cols = Wo[:, g * per_group * d : (g + 1) * per_group * d].reshape(Wo.shape[0], per_group, d)
            blocks.append(torch.einsum("mhi,mhj->ij", cols, cols))
        return block_diagonal(blocks)


def layer_inv_freq(rotary: torch.nn.Module, config, index: int) -> torch.Tensor:
    """The RoPE frequencies of layer ``index`` (Gemma 3 keeps one set per layer type)."""
    types = getattr(config, "layer_types", None)
    if types and hasattr(rotary, f"{types[index]}_inv_freq"):
        return getattr(rotary, f"{types[index]}_inv_freq")
    return rotary.inv_freq


def layer_contexts(source: PreTrainedModel, family: Family, stats, seq_len: int) -> list[LayerContext]:
    config = source.config
    rotary = source.get_submodule(family.rotary_path)
    layers = source.get_submodule(family.layers_path)
    return [
        LayerContext(getattr(layer, family.attention_attr), x, o, layer_inv_freq(rotary, config, index),
                     config.num_attention_heads, config.num_key_value_heads, seq_len)
        for index, (layer, (x, o)) in enumerate(zip(layers, stats, strict=True))
    ]
