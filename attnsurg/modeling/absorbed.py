"""Absorbed latent attention for DeepseekV3 models: attention over the cached latent, shared by every head.

Stock transformers expands the whole cached latent c (and the shared RoPE key k_R) into every head's keys
and values at every step (``DeepseekV3Attention.expand_kv``): per cached token, per layer, per step that is
``H (d_nope + d_v) r`` multiply-adds. DeepSeek-V2 (sec. 2.1.2) folds the up-projections into the query and
the output instead. With ``kv_b_proj.weight`` viewed per head as ``[W_UK_h; W_UV_h]`` (``d_nope x r`` and
``d_v x r``):

    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rope_h . k_R          (the key up-projection on the query side)
    o_h       = W_UV_h (sum_j p_hj c_j)                            (the value up-projection after the softmax)

so every head attends over the same cached ``[c, k_R]`` (one head of width ``r + d_rope``, read once per
step for all heads) and a cached token costs ``H (2 r + d_rope)``. The checkpoint stays a stock DeepseekV3
checkpoint; only the order of operations changes, and the logits equal the stock path's to float rounding.

``use_runtime(model, "attnsurg")`` switches a loaded model's DeepseekV3 attention modules to this class,
``use_runtime(model, "stock")`` back. No attention weights are returned (none are formed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention, apply_rotary_pos_emb, apply_rotary_pos_emb_interleave,
)

from attnsurg.requests import Runtime

RUNTIMES: tuple[Runtime, ...] = ("attnsurg", "stock")

# Up to this many new tokens per step the scores are two plain matmuls against the cache as stored (no copy
# of it); a longer step (a prefill) goes through one fused SDPA call over the concatenated [c, k_R].
MATMUL_QUERIES = 16


class AbsorbedMLAAttention(DeepseekV3Attention):
    """DeepseekV3 attention computed in the latent space: the same weights, cache and outputs."""

    def latent_inputs(self, hidden_states, position_embeddings, cache, kwargs):
        """The queries (no-RoPE and RoPE parts, per head) and the whole cached latent and RoPE key, exactly as
        the stock forward forms them."""
        batch_size, seq_length = hidden_states.shape[:-1]
        if self.q_lora_rank is None:
            q_states = self.q_proj(hidden_states)
        else:
            q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_states = q_states.view(batch_size, seq_length, -1, self.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states),
                                    [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(batch_size, 1, seq_length, self.kv_lora_rank)
        k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        rotate = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
        if cache is not None:
            latent, k_rot = cache.update(latent, k_rot, self.layer_idx, kwargs=kwargs)
        return q_pass, q_rot, latent, k_rot

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK and W_UV per head, views of kv_b_proj's weight: [H, d_nope, r] and [H, d_v, r]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        batch_size, seq_length = hidden_states.shape[:-1]
        q_pass, q_rot, latent, k_rot = self.latent_inputs(hidden_states, position_embeddings, cache, kwargs)
        w_uk, w_uv = self.up_projections()
        q_latent = torch.matmul(q_pass, w_uk)  # [B, H, S, r]
        mask = key_mask(attention_mask, seq_length, latent.shape[2], latent.device)
        if seq_length <= MATMUL_QUERIES:
            if mask is None and seq_length > 1:  # SDPA's is_causal has no counterpart in the plain matmuls
                mask = causal_tail(seq_length, latent.shape[2], latent.device)
            mixed = latent_attention_matmul(q_latent, q_rot, latent, k_rot, mask, self.scaling)
        else:
            mixed = latent_attention_sdpa(q_latent, q_rot, latent, k_rot, mask, self.scaling)
        output = torch.matmul(mixed, w_uv.transpose(1, 2))  # [B, H, S, d_v]
        output = output.transpose(1, 2).reshape(batch_size, seq_length, -1)
        return self.o_proj(output), None


def key_mask(attention_mask: torch.Tensor | None, queries: int, keys: int, device) -> torch.Tensor | None:
    """The mask over the cached keys as a boolean [B or 1, 1, S, T] (True: attend), or None where every query
    sees every key before it and the queries are the last S positions with S = T or S = 1."""
    if attention_mask is None:
        if queries == 1 or queries == keys:
            return None
        return causal_tail(queries, keys, device)
    mask = attention_mask[..., :keys]
    if mask.dtype != torch.bool:
        mask = mask == 0  # an additive mask: 0 where attended, a large negative number elsewhere
    return mask


def causal_tail(queries: int, keys: int, device) -> torch.Tensor:
    """Query i (the i-th of the last ``queries`` positions) sees keys 0 .. keys - queries + i."""
    rows = torch.arange(keys - queries, keys, device=device)[:, None]
    return (torch.arange(keys, device=device)[None, :] <= rows)[None, None]


def latent_attention_matmul(q_latent, q_rot, latent, k_rot, mask, scaling) -> torch.Tensor:
    """A few queries: heads folded into the query axis, so one [H S, r] x [r, T] product per batch row reads
    the cached latent once for all heads (no copy, no per-head key)."""
    batch, heads, queries, _ = q_latent.shape
    keys = latent.shape[2]
    scores = torch.matmul(q_latent.reshape(batch, 1, heads * queries, -1), latent.transpose(-1, -2))
    scores = scores + torch.matmul(q_rot.reshape(batch, 1, heads * queries, -1), k_rot.transpose(-1, -2))
    scores = scores.view(batch, heads, queries, keys) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(latent.dtype)
    mixed = torch.matmul(probs.view(batch, 1, heads * queries, keys), latent)
    return mixed.view(batch, heads, queries, -1)


def latent_attention_sdpa(q_latent, q_rot, latent, k_rot, mask, scaling) -> torch.Tensor:
    """Many queries (a prefill): one SDPA call with a single key head of width r + d_rope shared by all
    heads; the value (the latent) is zero-padded to that width so the fused kernels apply, then cut back."""
    rank = latent.shape[-1]
    query = torch.cat([q_latent, q_rot], dim=-1)
    key = torch.cat([latent, k_rot], dim=-1)
    value = F.pad(latent, (0, k_rot.shape[-1]))
    causal = mask is None and query.shape[2] > 1
    mixed = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scaling,
                                           enable_gqa=True)
    return mixed[..., :rank]


def use_runtime(model: torch.nn.Module, runtime: Runtime) -> int:
    """Switch every DeepseekV3 attention module of ``model`` to the absorbed form ("attnsurg") or back to the
    stock one ("stock"); the number of modules whose class changed. Weights and caches are untouched."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}")
    target = AbsorbedMLAAttention if runtime == "attnsurg" else DeepseekV3Attention
    changed = 0
    for module in model.modules():
        if isinstance(module, DeepseekV3Attention) and type(module) is not target:
            module.__class__ = target
            changed += 1
    return changed


def runtime_applies(model: torch.nn.Module) -> bool:
    """Whether the attnsurg runtime changes anything in this model."""
    return any(isinstance(module, DeepseekV3Attention) for module in model.modules())
