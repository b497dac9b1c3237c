"""Modeling code for checkpoints written by ``attnsurg compress`` and ``attnsurg convert --to linear``
(factorized, top-k or linear attention).

This file is self-contained (torch and transformers only): attnsurg copies it into every checkpoint it
writes, where ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` finds it through the
config's ``auto_map``; attnsurg itself registers the same classes and loads such checkpoints without
remote code.

A checkpoint keeps its family's architecture and records its surgery in ``config.attnsurg``:

- ``low_rank``: module path -> rank. That ``nn.Linear`` becomes :class:`LowRankLinear` (``down``: in -> r,
  ``up``: r -> out, with the original bias), so the factors, not a dense product, are what is stored.
- ``head_tensor``: module path -> Tucker or CP spec. That projection's per-head weights are kept as a
  decomposed heads x head_dim x hidden tensor (:class:`TuckerProjection`, :class:`CPProjection`).
- ``factored_kv``: layer index -> [k rank, v rank]. Both k and v of that layer are head tensors whose
  hidden factors are narrower than K and V; the cache holds those coordinates (:class:`FactoredKVAttention`).
- ``stacked_tucker``: layer index -> {ranks: [R_dim, R_hidden], cache_latent}. That layer's q, k, v and o
  come from one Tucker decomposition with factors shared by every head and projection
  (:class:`StackedTuckerAttention`); with ``cache_latent`` the cache holds the shared hidden coordinates.
- ``kv_latent``: layer index -> rank. That layer's k/v projections become one shared down projection to an
  r-dimensional latent and one up projection to [K; V] (:class:`LatentKVAttention`). The cache holds the
  latent, not K and V; keys are rebuilt from it and rotated afterwards (Palu, Chang et al. 2024, sec. 3).
- ``loki``: {"rank": r, "top_k": count or fraction}: every layer scores keys with r PCA coordinates and
  attends over its top-k (:class:`LokiAttention`).
- ``linear``: {"window": w, "feature_dim": F, "sinks": s, "feature_map": "hedgehog" or "performer"}: every layer
  attends exactly over its last w keys and its first s, and through a feature map over the other older ones,
  whose keys and values are folded into a fixed-size state (:class:`HybridLinearAttention`); the cache holds the
  window, the sinks and the state, whatever the context's length.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch
from torch import nn
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as soft_capped_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward


class LowRankLinear(nn.Module):
    """``y = up(down(x))``: a rank-r factorization of an ``nn.Linear`` (bias on ``up``)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool) -> None:
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=bias)

    @property
    def in_features(self) -> int:
        return self.down.in_features

    @property
    def out_features(self) -> int:
        return self.up.out_features

    @property
    def rank(self) -> int:
        return self.down.out_features

    @property
    def bias(self) -> torch.Tensor | None:
        return self.up.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


class HeadTensorProjection(nn.Module):
    """A projection whose per-head weights form a heads x head_dim x hidden tensor, stored decomposed.

    ``heads_on="output"`` (q/k/v): head h maps the hidden state x to its d outputs with W_h (d x D);
    ``heads_on="input"`` (o): head h's d inputs map to the hidden state with W_h^T. Factors over the
    hidden mode and the head-dim mode are shared by all heads (one tensor each).
    """

    def __init__(self, hidden: int, heads: int, head_dim: int, heads_on: str, bias: bool) -> None:
        super().__init__()
        self.hidden_size, self.heads, self.head_dim, self.heads_on = hidden, heads, head_dim, heads_on
        self.bias = nn.Parameter(torch.zeros(heads * head_dim if heads_on == "output" else hidden)) if bias else None

    def head_mix(self) -> torch.Tensor:
        """[heads, rank_dim, rank_hidden]: each head's map between the two shared bases."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Output heads: the shared hidden-mode coordinates [..., R_hidden], once per token for all heads."""
        return x @ self.factor_hidden

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Output heads: every head's outputs [..., heads * head_dim] from the shared coordinates."""
        y = torch.einsum("...t,hst,ds->...hd", z, self.head_mix(), self.factor_dim).flatten(-2)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.heads_on == "output":
            return self.decode(self.encode(x))
        u = x.unflatten(-1, (self.heads, self.head_dim)) @ self.factor_dim  # [..., H, R_dim]
        y = torch.einsum("...hs,hst->...t", u, self.head_mix()) @ self.factor_hidden.T
        return y if self.bias is None else y + self.bias


class TuckerProjection(HeadTensorProjection):
    """W_h = B (sum_r A[h, r] G[r]) C^T: Tucker factors A (heads x R1), B (head_dim x R2), C (hidden x R3)
    and core G (R1 x R2 x R3) (Tucker 1966; per-head attention weights as in TensorLLM, Gu et al. 2025)."""

    def __init__(self, hidden: int, heads: int, head_dim: int, ranks: list[int], heads_on: str, bias: bool) -> None:
        super().__init__(hidden, heads, head_dim, heads_on, bias)
        r_heads, r_dim, r_hidden = ranks
        self.factor_heads = nn.Parameter(torch.zeros(heads, r_heads))
        self.factor_dim = nn.Parameter(torch.zeros(head_dim, r_dim))
        self.factor_hidden = nn.Parameter(torch.zeros(hidden, r_hidden))
        self.core = nn.Parameter(torch.zeros(r_heads, r_dim, r_hidden))

    def head_mix(self) -> torch.Tensor:
        return torch.einsum("hr,rst->hst", self.factor_heads, self.core)


class CPProjection(HeadTensorProjection):
    """W_h = B diag(A[h]) C^T: rank-R CP factors; C is a projection shared by every head and A[h] its
    mixing vector, as in collaborative attention (Cordonnier et al. 2020, eq. 5), applied per projection
    so RoPE still acts on the rebuilt queries and keys."""

    def __init__(self, hidden: int, heads: int, head_dim: int, rank: int, heads_on: str, bias: bool) -> None:
        super().__init__(hidden, heads, head_dim, heads_on, bias)
        self.factor_heads = nn.Parameter(torch.zeros(heads, rank))
        self.factor_dim = nn.Parameter(torch.zeros(head_dim, rank))
        self.factor_hidden = nn.Parameter(torch.zeros(hidden, rank))

    def head_mix(self) -> torch.Tensor:
        return torch.diag_embed(self.factor_heads)

    def decode(self, z: torch.Tensor) -> torch.Tensor:  # diagonal mix: elementwise instead of a dense core
        y = ((z.unsqueeze(-2) * self.factor_heads) @ self.factor_dim.T).flatten(-2)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.heads_on == "output":
            return self.decode(self.encode(x))
        u = x.unflatten(-1, (self.heads, self.head_dim)) @ self.factor_dim  # [..., H, R]
        y = (u * self.factor_heads).sum(-2) @ self.factor_hidden.T
        return y if self.bias is None else y + self.bias


def require_dynamic_cache(cache) -> None:
    """Positions are counted from the cache length, which only a dynamic cache reports truthfully."""
    if cache is not None and getattr(cache, "is_compileable", False):
        raise ValueError("attnsurg's latent, factored and Loki attention need a dynamic cache (DynamicCache), "
                         "not a static or compiled one")


def key_mask(attention_mask: torch.Tensor | None, total: int) -> torch.Tensor | None:
    """The attention mask as booleans [B, 1, T or 1, S] (True: may attend), whatever form it came in."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        attention_mask = attention_mask[:, None, None, :]
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    return attention_mask[..., -total:]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout of the Llama family; cos/sin: ``[batch, seq, head_dim]``."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def layer_window(config, layer_idx: int) -> int | None:
    """The sliding window of this layer (None: it sees the whole context), as the family's own attention reads it."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


def soft_capped(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's score soft-capping, cap * tanh(s / cap) (monotone: it changes no top-k)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


class AttentionBase(nn.Module):
    """The settings every attnsurg attention shares with the family's own: head sizes, groups, the query scale
    (Gemma's ``query_pre_attn_scalar``), score soft-capping (Gemma 2) and this layer's sliding window."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.softcap: float | None = getattr(config, "attn_logit_softcapping", None)
        self.sliding_window = layer_window(config, layer_idx)
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.q_norm: nn.Module | None = None  # per-head RMSNorms of queries and keys before RoPE (Qwen3)
        self.k_norm: nn.Module | None = None

    def carry_norms(self, old: nn.Module) -> None:
        """Keep the replaced attention's q/k norms (same names, so the checkpoint's weights load into them)."""
        self.q_norm, self.k_norm = getattr(old, "q_norm", None), getattr(old, "k_norm", None)

    def normed(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys [batch, heads, tokens, d] through the q/k norms where the family has them."""
        if self.q_norm is None:
            return query, key
        return self.q_norm(query), self.k_norm(key)


class RebuiltKVAttention(AttentionBase):
    """Attention whose cache holds something narrower than K and V, rebuilt into K and V at every step
    (``keys_and_values``), with RoPE applied to the rebuilt keys. Rotations are relative, so key positions
    are counted from the start of the cache and query positions continue them; left padding shifts both
    alike and changes no score."""

    rotary: Callable | None = None  # the model's rotary embedding, set by the model (not a submodule)

    def keys_and_values(self, hidden_states: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, [batch, G, all cached tokens, d], before RoPE."""
        raise NotImplementedError

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else past_key_values
        require_dynamic_cache(cache)
        batch, length, _ = hidden_states.shape
        query, key, value = self.project(hidden_states, cache)
        query, key = self.normed(query, key)
        total = key.shape[2]

        positions = torch.arange(total, device=hidden_states.device).unsqueeze(0)
        cos, sin = self.rotary(value, positions)
        key = apply_rope(key, cos, sin)
        query = apply_rope(query, cos[:, total - length :], sin[:, total - length :])

        # as the family's own attention picks it: soft-capped scores (Gemma 2) fall back to Gemma 2's eager form
        eager = eager_attention_forward if self.softcap is None else soft_capped_attention_forward
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            **kwargs,
        )
        return self.output(output.reshape(batch, length, -1).contiguous()), weights

    def project(self, hidden_states: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [batch, H, new tokens, d] and K, V [batch, G, all cached tokens, d], before RoPE."""
        batch, length, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
        return (query, *self.keys_and_values(hidden_states, cache))

    def output(self, heads: torch.Tensor) -> torch.Tensor:
        """The attention output [batch, tokens, H d] mapped back to the hidden state."""
        return self.o_proj(heads)


def cached_latent(latent: torch.Tensor, cache, layer_idx: int) -> torch.Tensor:
    """Append this step's latent [batch, new tokens, r] to the cache (split over its key and value slots)
    and return the whole cached latent [batch, all tokens, r]."""
    if cache is None:
        return latent
    half = (latent.shape[-1] + 1) // 2
    first, second = cache.update(latent[..., :half].unsqueeze(1), latent[..., half:].unsqueeze(1), layer_idx)
    return torch.cat([first, second], dim=-1).squeeze(1)


class LatentKVAttention(RebuiltKVAttention):
    """The cache holds one latent per token for K and V together: ``kv_down`` maps the input to the latent
    c (width r, cached); ``kv_up`` maps c to [K; V] (rows: the G key heads, then the G value heads)."""

    def __init__(self, config, layer_idx: int, rank: int, kv_bias: bool, q_proj: nn.Module, o_proj: nn.Module):
        super().__init__(config, layer_idx)
        self.q_proj = q_proj
        self.o_proj = o_proj
        self.kv_down = nn.Linear(config.hidden_size, rank, bias=False)
        self.kv_up = nn.Linear(rank, 2 * self.num_key_value_heads * self.head_dim, bias=kv_bias)

    @property
    def latent_rank(self) -> int:
        return self.kv_down.out_features

    def keys_and_values(self, hidden_states: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([batch, G, all cached tokens, d], before RoPE) rebuilt from the cached latent."""
        latent = cached_latent(self.kv_down(hidden_states), cache, self.layer_idx)
        batch, total = latent.shape[:2]
        kv = self.kv_up(latent).view(batch, total, 2, self.num_key_value_heads, self.head_dim)
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

    def up_projection(self, part: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kv_up's rows for the keys (``part`` 0) or the values (1): weight [G d, r] and bias."""
        rows = slice(part * self.num_key_value_heads * self.head_dim, (part + 1) * self.num_key_value_heads * self.head_dim)
        return self.kv_up.weight[rows], None if self.kv_up.bias is None else self.kv_up.bias[rows]

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None,
                **kwargs):
        """A decoding step (one new token) never rebuilds the values. Its attention weights p_j sum to 1, so
        sum_j p_j (W_v c_j + b_v) = W_v (sum_j p_j c_j) + b_v: each head mixes the cached latent (r wide, shared
        by every head) and maps the mix through its group's value rows, H r instead of G d r multiply-adds per
        cached token. The keys are rebuilt as before: RoPE rotates each one by its own position."""
        cache = cache if cache is not None else past_key_values
        if hidden_states.shape[1] != 1 or self.training or kwargs.get("output_attentions"):
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        require_dynamic_cache(cache)
        batch, heads = hidden_states.shape[0], self.config.num_attention_heads
        latent = cached_latent(self.kv_down(hidden_states), cache, self.layer_idx)  # [B, T, r]
        total = latent.shape[1]
        query = self.q_proj(hidden_states).view(batch, 1, heads, self.head_dim).transpose(1, 2)
        key = nn.functional.linear(latent, *self.up_projection(0)).view(batch, total, -1, self.head_dim).transpose(1, 2)
        query, key = self.normed(query, key)
        cos, sin = self.rotary(latent, torch.arange(total, device=latent.device).unsqueeze(0))
        key, query = apply_rope(key, cos, sin), apply_rope(query, cos[:, -1:], sin[:, -1:])
        groups = self.num_key_value_groups
        scores = query.view(batch, self.num_key_value_heads, groups, self.head_dim) @ key.transpose(-1, -2)
        scores = soft_capped(scores * self.scaling, self.softcap)  # [B, G, groups, T]
        mask = key_mask(attention_mask, total)
        if mask is not None:
            scores = scores.masked_fill(~mask.view(mask.shape[0], 1, 1, total), torch.finfo(scores.dtype).min)
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(latent.dtype)
        mixed = weights.view(batch, heads, total) @ latent  # [B, H, r]
        value, bias = self.up_projection(1)
        value = value.view(self.num_key_value_heads, self.head_dim, -1).repeat_interleave(groups, dim=0)  # [H, d, r]
        output = torch.einsum("bhr,hdr->bhd", mixed, value)
        if bias is not None:
            output = output + bias.view(self.num_key_value_heads, self.head_dim).repeat_interleave(groups, dim=0)
        return self.output(output.reshape(batch, 1, heads * self.head_dim)), None


class FactoredKVAttention(RebuiltKVAttention):
    """Attention whose k and v projections are head tensors (Tucker or CP) with a shared hidden factor: the
    cache holds each one's hidden-mode coordinates (key slot: k's, value slot: v's), narrower than K and V,
    and every step decodes K and V from them, then rotates the keys."""

    def __init__(self, config, layer_idx: int, q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module, o_proj: nn.Module):
        super().__init__(config, layer_idx)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj

    def keys_and_values(self, hidden_states: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        zk, zv = self.k_proj.encode(hidden_states).unsqueeze(1), self.v_proj.encode(hidden_states).unsqueeze(1)
        if cache is not None:
            zk, zv = cache.update(zk, zv, self.layer_idx)
        batch, total = zk.shape[0], zk.shape[2]
        G, d = self.num_key_value_heads, self.head_dim
        key = self.k_proj.decode(zk.squeeze(1)).view(batch, total, G, d).transpose(1, 2)
        value = self.v_proj.decode(zv.squeeze(1)).view(batch, total, G, d).transpose(1, 2)
        return key, value


class StackedTuckerAttention(RebuiltKVAttention):
    """q, k, v and o of every head from one Tucker decomposition of the layer (TensorLLM, Gu et al. 2025):
    head h of projection p is B C_{p,h} A^T, with A (hidden x R_hidden) and B (head_dim x R_dim; absent when
    folded into the cores) shared by every head and projection. u = x A is computed once per token for q, k
    and v; o writes back through A. With ``cache_latent`` the cache holds u instead of K and V."""

    def __init__(self, config, layer_idx: int, ranks: list[int], cache_latent: bool, biases: dict[str, bool]):
        super().__init__(config, layer_idx)
        r_dim, r_hidden = ranks
        H, G, d, D = config.num_attention_heads, self.num_key_value_heads, self.head_dim, config.hidden_size
        self.cache_latent = cache_latent
        self.factor_hidden = nn.Parameter(torch.zeros(D, r_hidden))
        self.factor_dim = nn.Parameter(torch.zeros(d, r_dim)) if r_dim < d else None
        for name, heads, bias_size in (("q", H, H * d), ("k", G, G * d), ("v", G, G * d), ("o", H, D)):
            setattr(self, f"core_{name}", nn.Parameter(torch.zeros(heads, r_dim, r_hidden)))
            setattr(self, f"{name}_bias", nn.Parameter(torch.zeros(bias_size)) if biases[name] else None)

    def heads_from(self, u: torch.Tensor, core: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[batch, tokens, R_hidden] -> [batch, heads, tokens, d] through each head's core (and B)."""
        y = torch.einsum("btr,hsr->bths", u, core)
        if self.factor_dim is not None:
            y = y @ self.factor_dim.T
        if bias is not None:
            y = y + bias.view(core.shape[0], self.head_dim)
        return y.transpose(1, 2)

    def project(self, hidden_states: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u = hidden_states @ self.factor_hidden
        query = self.heads_from(u, self.core_q, self.q_bias)
        if self.cache_latent:
            u = cached_latent(u, cache, self.layer_idx)
        key, value = self.heads_from(u, self.core_k, self.k_bias), self.heads_from(u, self.core_v, self.v_bias)
        if cache is not None and not self.cache_latent:
            key, value = cache.update(key, value, self.layer_idx)
        return query, key, value

    def output(self, heads: torch.Tensor) -> torch.Tensor:
        o = heads.unflatten(-1, (-1, self.head_dim))
        if self.factor_dim is not None:
            o = o @ self.factor_dim
        y = torch.einsum("bths,hsr->btr", o, self.core_o) @ self.factor_hidden.T
        return y if self.o_bias is None else y + self.o_bias


LOKI_QUERY_BLOCK = 256  # queries scored together in Loki's prefill


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class LokiAttention(AttentionBase):
    """Top-k attention with keys scored in a PCA basis (Loki, Singhania et al. 2024, alg. 1).

    Per KV head g an orthonormal basis P_g (principal directions of the post-RoPE keys, strongest first):
    queries and keys are rotated into it after RoPE, so q P . k P = q . k and the cache holds keys already
    rotated, their first ``rank`` coordinates in the key slot (contiguous, what scoring reads) and the rest
    with the values in the value slot. Each query scores every key with the first ``rank`` coordinates only, keeps the ``top_k`` best
    (a count, or a fraction of its context; the current token always), and attends exactly over those.
    """

    def __init__(self, config, layer_idx: int, q_proj, k_proj, v_proj, o_proj, rank: int, top_k: float):
        super().__init__(config, layer_idx)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.loki_basis = nn.Parameter(torch.zeros(self.num_key_value_heads, self.head_dim, self.head_dim))
        self.rank, self.top_k = rank, top_k
        self.recall: list[float] | None = None  # set to a list to record top-k recall per forward

    def keep_counts(self, context: torch.Tensor) -> torch.Tensor:
        """How many keys each query keeps, given how many it may see."""
        if isinstance(self.top_k, float):
            keep = torch.ceil(context.double() * self.top_k).long()
        else:
            keep = torch.full_like(context, int(self.top_k))
        return torch.minimum(keep.clamp_min(1), context)

    def selection(
        self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, rank: int | None = None
    ) -> torch.Tensor:
        """[B, H, T, S] bool: the keys each query attends to (causal and unmasked, top-k by rank-r scores)."""
        rank = self.rank if rank is None else rank
        length, total = query.shape[2], key.shape[2]
        positions = torch.arange(total - length, total, device=query.device)
        keys = torch.arange(total, device=query.device)[None, :]
        allowed = keys <= positions[:, None]  # [T, S]
        if self.sliding_window is not None:  # as the family's own sliding layers: the last ``window`` tokens
            allowed &= keys > positions[:, None] - self.sliding_window
        allowed = allowed if mask is None else allowed & mask  # padding
        allowed = allowed.expand(query.shape[0], query.shape[1], -1, -1)
        context = allowed.sum(-1)
        keep = self.keep_counts(context)
        if bool((keep == context).all()):
            return allowed
        approx = query[..., :rank].float() @ key[..., :rank].float().transpose(-1, -2)  # float32: fewer ties in bf16
        approx = approx.masked_fill(~allowed, float("-inf"))
        current = torch.arange(length, device=query.device)
        approx[..., current, positions] = torch.where(allowed[..., current, positions], float("inf"), float("-inf"))
        # A partial top-k of the largest count any row keeps, then each row keeps its own first ``keep`` of it:
        # exactly keep keys per query (ties broken as topk breaks them), without a full sort of every row.
        most = int(keep.max())
        best = approx.topk(most, dim=-1).indices
        kept = torch.arange(most, device=query.device) < keep.unsqueeze(-1)
        return torch.zeros_like(allowed).scatter(-1, best, kept) & allowed

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        cache = cache if cache is not None else past_key_values
        require_dynamic_cache(cache)
        batch, length, _ = hidden_states.shape
        d, groups = self.head_dim, self.num_key_value_groups
        query = self.q_proj(hidden_states).view(batch, length, -1, d).transpose(1, 2)
        key = self.k_proj(hidden_states).view(batch, length, -1, d).transpose(1, 2)
        value = self.v_proj(hidden_states).view(batch, length, -1, d).transpose(1, 2)
        query, key = self.normed(query, key)
        cos, sin = position_embeddings
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        query = torch.einsum("bhtd,hde->bhte", query, repeat_heads(self.loki_basis.unsqueeze(0), groups)[0])
        key = torch.einsum("bgtd,gde->bgte", key, self.loki_basis)
        # Cache layout: key slot = the scored prefix (first r coordinates, contiguous), value slot = the rest
        # of the key followed by the value; the same values per token as a plain cache.
        prefix, rest = key[..., : self.rank].contiguous(), torch.cat([key[..., self.rank :], value], dim=-1)
        if cache is not None:
            prefix, rest = cache.update(prefix, rest, self.layer_idx)
        total = prefix.shape[2]
        mask = key_mask(attention_mask, total)
        keep = int(self.keep_counts(torch.tensor([total]))[0])
        whole_window = self.sliding_window is None or total <= self.sliding_window
        if length == 1 and keep < total and self.recall is None and whole_window and (mask is None or bool(mask.all())):
            return self.o_proj(self.decode_step(query, prefix, rest, keep)), None
        key = torch.cat([prefix, rest[..., : d - self.rank]], dim=-1)
        value = rest[..., d - self.rank :]
        output = self.blockwise_attention(query, key, value, mask)
        return self.o_proj(output.transpose(1, 2).reshape(batch, length, -1)), None

    def blockwise_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Exact attention over each query's selected keys, LOKI_QUERY_BLOCK queries at a time, each block
        against only the keys its last query may see: memory O(block x keys), and the causal triangle's
        upper half is never scored."""
        length, total, groups = query.shape[2], key.shape[2], self.num_key_value_groups
        outputs, hits, exact_total = [], 0, 0
        for start in range(0, length, LOKI_QUERY_BLOCK):
            stop = min(start + LOKI_QUERY_BLOCK, length)
            visible = total - length + stop
            q = query[:, :, start:stop]
            k, v = repeat_heads(key[:, :, :visible], groups), repeat_heads(value[:, :, :visible], groups)
            m = None if mask is None else mask[..., :visible]
            if m is not None and m.shape[-2] > 1:
                m = m[..., start:stop, :]
            selected = self.selection(q, k, m)
            if self.recall is not None:  # share of the exact top-k (same counts, causal) the rank-r scores kept
                exact = self.selection(q, k, m, rank=self.head_dim)
                hits, exact_total = hits + int((exact & selected).sum()), exact_total + int(exact.sum())
            scores = soft_capped((q @ k.transpose(-1, -2)) * self.scaling, self.softcap)
            scores = scores.masked_fill(~selected, float("-inf"))
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).nan_to_num(0.0).to(q.dtype)  # padded queries
            outputs.append(weights @ v)
        if self.recall is not None:
            self.recall.append(hits / max(exact_total, 1))
        return torch.cat(outputs, dim=2)

    def decode_step(self, query: torch.Tensor, prefix: torch.Tensor, rest: torch.Tensor, keep: int) -> torch.Tensor:
        """One new token: rank-r scores read only the cached prefixes, then the top-k keys and values are
        gathered by row (per query head, from its KV group), exact softmax over those."""
        batch, d, groups, r = query.shape[0], self.head_dim, self.num_key_value_groups, self.rank
        q = query.view(batch, self.num_key_value_heads, groups, d)  # [B, G, per-group heads, d]
        approx = torch.einsum("bgqr,bgsr->bgqs", q[..., :r], prefix)
        approx[..., -1] = float("inf")  # the current token
        index = approx.topk(keep, dim=-1).indices  # [B, G, q, k]
        rows = torch.arange(batch, device=q.device)[:, None, None, None]
        kv_heads = torch.arange(self.num_key_value_heads, device=q.device)[None, :, None, None]

        def gathered(cached: torch.Tensor) -> torch.Tensor:  # whole rows of [B, G, S, w] -> [B, G, q, k, w]
            return cached[rows, kv_heads, index]

        rest_top = gathered(rest)
        k_top = torch.cat([gathered(prefix), rest_top[..., : d - r]], dim=-1)
        scores = soft_capped(torch.einsum("bgqd,bgqkd->bgqk", q, k_top) * self.scaling, self.softcap)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("bgqk,bgqkd->bgqd", weights, rest_top[..., d - r :]).reshape(batch, 1, -1)


LINEAR_CHUNK = 128  # new tokens a hybrid linear attention takes at once: prefill cost O(T (w + chunk))


def hedgehog_log(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The log of Hedgehog's feature map (Zhang et al. 2024, eq. 5): [softmax(x W + b), softmax(-(x W + b))] per
    head; x [B, heads, T, d], weight [heads, d, F], bias [heads, F] -> [B, heads, T, 2F], computed in float32."""
    projected = torch.einsum("bhtd,hdf->bhtf", x.float(), weight.float()) + bias.float()[None, :, None]
    return torch.cat([torch.log_softmax(projected, dim=-1), torch.log_softmax(-projected, dim=-1)], dim=-1)


def performer_log(x: torch.Tensor, weight: torch.Tensor, scaling: float) -> torch.Tensor:
    """The log of FAVOR+'s positive random features with the hyperbolic pair (Choromanski et al. 2021, Lemma 1):
    phi(x) = exp(-|x'|^2 / 2) / sqrt(2F) [exp(x' W), exp(-x' W)] with x' = x scaling^(1/2), so that
    E[phi(q) . phi(k)] = exp(q . k scaling). x [B, heads, T, d], weight [heads, d, F] (F random directions per
    head) -> [B, heads, T, 2F], float32."""
    x = x.float() * scaling**0.5
    projected = torch.einsum("bhtd,hdf->bhtf", x, weight.float())
    shift = x.pow(2).sum(-1, keepdim=True) / 2 + 0.5 * math.log(2 * weight.shape[-1])
    return torch.cat([projected, -projected], dim=-1) - shift


FEATURE_MAPS = ("hedgehog", "performer")


class LinearStateLayer(DynamicSlidingWindowLayer):
    """One hybrid linear layer's cache: the last ``window`` keys and values (the sliding window layer holds
    ``sliding_window - 1`` of them), the sink keys and values (the first ``sinks`` of the sequence, once they
    have left the window) and the state of every other older key, S = sum_j phi(k_j) v_j^T [B, G, 2F, d] and
    z = sum_j phi(k_j) [B, G, 2F], both float32. With a decay delta per KV head each key is weighed
    exp(-delta (t - j)) at position t; S and z are held at position ``anchor`` (the last key folded in) and
    divided by exp(shift) per feature, ``shift`` [B, G, 2F] the largest log-weight folded in so far, so no
    feature over- or underflows whatever the keys' scale or the context's length (as online softmax does). Its
    length counts every token seen."""

    def __init__(self, window: int) -> None:
        super().__init__(sliding_window=window + 1)
        self.state: torch.Tensor | None = None
        self.normalizer: torch.Tensor | None = None
        self.shift: torch.Tensor | None = None
        self.anchor = 0
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None

    def keep_sinks(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copies, so the window's larger storage these may be views of is not held."""
        self.sink_keys = keys.clone() if self.sink_keys is None else torch.cat([self.sink_keys, keys], dim=2)
        self.sink_values = values.clone() if self.sink_values is None else torch.cat([self.sink_values, values], dim=2)

    def with_sinks(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> tuple[torch.Tensor, ...]:
        """The sink keys and values kept so far before ``keys``/``values`` (whose first is at position
        ``first``), and the positions of them all."""
        positions = torch.arange(first, first + keys.shape[2], device=keys.device)
        if self.sink_keys is None:
            return keys, values, positions
        held = torch.arange(self.sink_keys.shape[2], device=keys.device)
        return (torch.cat([self.sink_keys, keys], dim=2), torch.cat([self.sink_values, values], dim=2),
                torch.cat([held, positions]))

    def fold(self, log_features: torch.Tensor, values: torch.Tensor, first: int, decay: torch.Tensor) -> None:
        """Add keys older than the window (their log features [B, G, n, 2F], the first at position ``first``)
        to S and z, moving the anchor to the last of them and raising the shift where they exceed it."""
        anchor = first + log_features.shape[2] - 1
        offsets = torch.arange(first - anchor, 1, device=log_features.device)  # <= 0
        log_features = log_features + (decay[:, None] * offsets)[None, :, :, None]
        shift = log_features.detach().amax(2)
        if self.shift is not None:
            held = self.shift_at(anchor, decay)
            shift = torch.maximum(shift, held)
            rescale = torch.exp(held - shift)
            self.state, self.normalizer = self.state * rescale[..., None], self.normalizer * rescale
        features = torch.exp(log_features - shift[:, :, None])
        state, normalizer = features.transpose(-1, -2) @ values.float(), features.sum(2)
        self.state = state if self.state is None else self.state + state
        self.normalizer = normalizer if self.normalizer is None else self.normalizer + normalizer
        self.shift, self.anchor = shift, anchor

    def shift_at(self, position: int, decay: torch.Tensor) -> torch.Tensor:
        """The state's shift seen from ``position`` (>= the anchor): every key has decayed since."""
        return self.shift - (decay * (position - self.anchor))[None, :, None]

    def state_at(self, position: int, shift: torch.Tensor, decay: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """S and z seen from ``position``, divided by exp(``shift``) (>= the state's there, so nothing
        overflows)."""
        rescale = torch.exp(self.shift_at(position, decay) - shift)
        return self.state * rescale[..., None], self.normalizer * rescale


def linear_cache_layer(cache, layer_idx: int, window: int) -> LinearStateLayer:
    """This layer's slot of a dynamic cache as a :class:`LinearStateLayer` (placed there on first use)."""
    if not isinstance(cache, DynamicCache):
        raise ValueError("attnsurg's linear attention needs a dynamic cache (DynamicCache)")
    while len(cache.layers) <= layer_idx:
        cache.layers.append(LinearStateLayer(window))
    if not isinstance(cache.layers[layer_idx], LinearStateLayer):
        if cache.layers[layer_idx].is_initialized:
            raise ValueError("this cache was filled by another attention; start from an empty DynamicCache")
        cache.layers[layer_idx] = LinearStateLayer(window)
    return cache.layers[layer_idx]


def shifted_weights(scores: torch.Tensor, log_q: torch.Tensor, anchored: bool) -> tuple[torch.Tensor, ...]:
    """The exact part's weights exp(s - m - top) ([..., S], masked scores in) and the query features
    exp(log_q - top) that weigh the linear part (``log_q`` [..., 2F], already carrying the keys' shift), under
    one shift per query, top = max(0, largest log_q), so neither over- or underflows; with ``anchored`` the
    features are first put on the exact part's scale, exp(-m)."""
    largest = scores.amax(-1, keepdim=True)
    log_q = log_q - largest if anchored else log_q
    top = log_q.detach().amax(-1, keepdim=True).clamp(min=0.0)  # the exact part's largest weight is exp(0)
    return torch.exp(scores - (largest + top)), torch.exp(log_q - top)


def masked_scores(query: torch.Tensor, key: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """query . key [B, G, R, S] for query rows [B, G, R, d] and keys [B, G, S, d], -inf where ``seen`` [R, S]
    is False: the mask is added inside the product (one pass over the scores, not three)."""
    batch, kv_heads, rows, d = query.shape
    bias = torch.zeros(seen.shape, dtype=query.dtype, device=query.device).masked_fill(~seen, float("-inf"))
    scores = torch.baddbmm(bias, query.reshape(-1, rows, d), key.reshape(-1, *key.shape[2:]).transpose(1, 2))
    return scores.view(batch, kv_heads, rows, -1)


def hybrid_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_features: torch.Tensor,
    key_features: torch.Tensor, window: int, scaling: float, linear_scale: torch.Tensor,
    layer: LinearStateLayer | None = None, sinks: int = 0, key_positions: torch.Tensor | None = None,
    anchored: bool = False, decay: torch.Tensor | None = None,
) -> torch.Tensor:
    """LoLCATs' sliding-window + linear attention (Zhang et al. 2024, eq. 6) for the last T of S keys, with
    StreamingLLM's attention sinks (Xiao et al. 2024): the first ``sinks`` keys of the sequence stay exact.

    query [B, H, T, d] and the log of its features [B, H, T, 2F]; key, value [B, G, S, d] at ``key_positions``
    (ascending, default 0 .. S-1), the queries being the last T of them, and the log of the keys' features
    [B, G, S', 2F] for the first S' (at least those ``window`` or more before the last query; no other is
    read). Query i weighs key j by exp(s_ij - m_i) when i - j < window or j < sinks (s_ij = q_i . k_j *
    scaling, m_i the largest such score) and by exp(linear_scale_h - decay_g (i - j)) phi(q_i) . phi(k_j)
    otherwise (``decay`` [G] per token, default 0: the decayed linear attention of RetNet, Sun et al. 2023,
    eq. 1); ``layer`` holds the state of keys older than those given, none of them a sink. One normalisation
    over both parts.
    ``anchored``: the features' products estimate exp(s_ij) (Performer's), so the linear part is put on the
    exact part's scale, exp(-m_i). Every product is taken in log space under a shift per query and per
    feature, so neither part over- or underflows when the other dominates. A KV head's query heads are the
    rows of one product, and only the keys some query reads through the features (those at least ``window``
    before the last query) are scored by them. Returns [B, H, T, d] in float32."""
    batch, heads, length, d = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    rows = (batch, kv_heads, groups * length)
    by_group = (batch, kv_heads, groups, length)
    k, v = key.float(), value.float()
    positions = key_positions if key_positions is not None else torch.arange(total, device=query.device)
    decay = decay.float() if decay is not None else torch.zeros(kv_heads, device=query.device)
    last = int(positions[-1])  # the decay is taken from here: every offset is <= 0
    reach = int((positions <= last - window).sum())  # the keys any query reads through the features come first
    distance = positions[-length:, None] - positions[None, :]
    sink = positions < sinks
    exact_keys = (distance >= 0) & ((distance < window) | sink)
    linear_keys = ((distance >= window) & ~sink)[:, :reach]
    scores = masked_scores(query.float().reshape(*rows, d) * scaling, k, exact_keys.repeat(groups, 1))
    scores = scores.view(*by_group, total)
    log_k = key_features[:, :, :reach] + (decay[:, None] * (positions[:reach] - last))[None, :, :, None]
    log_k = log_k.masked_fill(~linear_keys.any(0)[None, None, :, None], float("-inf"))
    shift = (log_k.detach().amax(2) if reach
             else key_features.new_full((*key_features.shape[:2], key_features.shape[3]), float("-inf")))
    if layer is not None and layer.state is not None:
        shift = torch.maximum(shift, layer.shift_at(last, decay))
    shift = shift.nan_to_num(neginf=0.0)  # features no linear key reaches  [B, G, 2F]
    query_offset = linear_scale.float().view(kv_heads, groups, 1) + decay[:, None, None] * (last - positions[-length:])
    log_q = query_features.float().reshape(*by_group, -1) + shift[:, :, None, None] + query_offset[None, ..., None]
    exact, f_q = shifted_weights(scores, log_q, anchored)
    exact, f_q = exact.reshape(*rows, total), f_q.reshape(*rows, -1)
    numerator, denominator = exact @ v, exact.sum(-1, keepdim=True)
    if reach:
        f_k = torch.exp(log_k - shift[:, :, None])
        linear = (f_q @ f_k.transpose(-1, -2)).view(*by_group, reach).masked_fill(~linear_keys, 0.0)
        linear = linear.reshape(*rows, reach)
        numerator, denominator = numerator + linear @ v[:, :, :reach], denominator + linear.sum(-1, keepdim=True)
    if layer is not None and layer.state is not None:
        state, normalizer = layer.state_at(last, shift, decay)
        numerator, denominator = numerator + f_q @ state, denominator + f_q @ normalizer[..., None]
    return (numerator / denominator).view(batch, heads, length, d)


def retire(layer: LinearStateLayer, keys: torch.Tensor, values: torch.Tensor, log_features: torch.Tensor,
           first: int, sinks: int, decay: torch.Tensor) -> None:
    """Keys leaving the window (the first at position ``first``): sinks are kept as they are, the others
    fold into the state through their features (``log_features``, log phi(k))."""
    kept = min(max(sinks - first, 0), keys.shape[2])
    if kept:
        layer.keep_sinks(keys[:, :, :kept], values[:, :, :kept])
    if kept < keys.shape[2]:
        layer.fold(log_features[:, :, kept:], values[:, :, kept:], first + kept, decay)


class HybridLinearAttention(AttentionBase):
    """The source's projections, with softmax attention over the last ``window`` keys and the first ``sinks``
    of the sequence, and a linear attention over every other older key (LoLCATs, Zhang et al. 2024) through
    feature maps (per query head ``feature_q``, per KV head ``feature_k``): learned Hedgehog maps, or
    Performer's random features (``feature_map="performer"``, the biases unused); with ``decay``, older keys
    fade by exp(-delta_g) per token, delta_g = exp(``log_decay``_g) per KV head. The maps read the queries and
    keys after RoPE, or before it (``features_before_rope``: the linear part then sees no position, and
    scores keys at positions it was never fitted at as it scores the others). Decode
    costs the same at any context length: the cache (:class:`LinearStateLayer`) holds the window, the sinks
    and a fixed-size state, and new tokens are taken LINEAR_CHUNK at a time, so a prompt's cost grows
    linearly with its length."""

    def __init__(self, config, layer_idx: int, q_proj, k_proj, v_proj, o_proj, window: int, feature_dim: int,
                 sinks: int = 0, feature_map: str = "hedgehog", decay: bool = False,
                 features_before_rope: bool = False):
        super().__init__(config, layer_idx)
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"unknown feature map {feature_map!r}; attnsurg knows {', '.join(FEATURE_MAPS)}")
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.window, self.feature_dim, self.sinks, self.feature_map = window, feature_dim, sinks, feature_map
        self.anchored = feature_map == "performer"  # its features' products estimate exp(s) (see hybrid_attention)
        self.features_before_rope = features_before_rope
        heads, d = config.num_attention_heads, self.head_dim
        self.feature_q = nn.Parameter(torch.zeros(heads, d, feature_dim))
        self.feature_q_bias = nn.Parameter(torch.zeros(heads, feature_dim))
        self.feature_k = nn.Parameter(torch.zeros(self.num_key_value_heads, d, feature_dim))
        self.feature_k_bias = nn.Parameter(torch.zeros(self.num_key_value_heads, feature_dim))
        self.linear_scale = nn.Parameter(torch.zeros(heads))  # log of the linear part's weight, per query head
        self.log_decay = nn.Parameter(torch.full((self.num_key_value_heads,), -math.inf)) if decay else None

    rotary: Callable | None = None  # the model's rotary embedding, set by the model (not a submodule)

    def added_parameters(self) -> list[nn.Parameter]:
        """What a conversion adds to the source's attention: the feature maps, the linear part's weight and its
        decay."""
        added = [self.feature_q, self.feature_q_bias, self.feature_k, self.feature_k_bias, self.linear_scale]
        return added + ([self.log_decay] if self.log_decay is not None else [])

    def decay(self) -> torch.Tensor:
        """delta_g [G], the linear part's decay per token (0 without one)."""
        if self.log_decay is None:
            return torch.zeros(self.num_key_value_heads, device=self.linear_scale.device)
        return self.log_decay.float().exp()

    def rotated(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, ...]:
        """Queries [B, H, T, d], keys and values [B, G, T, d], as the family's attention forms them, then the
        queries and keys the feature maps read (before RoPE with ``features_before_rope``)."""
        batch, length, _ = hidden_states.shape
        shape = (batch, length, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        query, key = self.normed(query, key)
        cos, sin = position_embeddings
        rotated_query, rotated_key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        if self.features_before_rope:
            return rotated_query, rotated_key, value, query, key
        return rotated_query, rotated_key, value, rotated_query, rotated_key

    def keys_read(self, keys: torch.Tensor, first: int) -> torch.Tensor:
        """Cached keys (the first at position ``first``) as the feature maps read them: with
        ``features_before_rope`` rotated back, RoPE's rotation transposed and divided by its scale
        (cos^2 + sin^2, 1 but where a RoPE variant scales it), so the cache need not hold them twice."""
        if not self.features_before_rope or keys.shape[2] == 0:
            return keys
        if self.rotary is None:
            raise ValueError("maps read before RoPE need the model's rotary embedding; load the checkpoint with "
                             "attnsurg.load or its own modeling file")
        positions = torch.arange(first, first + keys.shape[2], device=keys.device)[None]
        cos, sin = (t.float() for t in self.rotary(keys, positions))
        return apply_rope(keys.float(), cos, -sin) / (cos * cos + sin * sin).unsqueeze(1)

    def query_features(self, query: torch.Tensor) -> torch.Tensor:
        """log phi(q) [B, H, T, 2F]."""
        if self.anchored:
            return performer_log(query, self.feature_q, self.scaling)
        return hedgehog_log(query, self.feature_q, self.feature_q_bias)

    def key_features(self, keys: torch.Tensor) -> torch.Tensor:
        """log phi(k) [B, G, S, 2F]."""
        if self.anchored:
            return performer_log(keys, self.feature_k, self.scaling)
        return hedgehog_log(keys, self.feature_k, self.feature_k_bias)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs) -> tuple[torch.Tensor, None]:
        cache = cache if cache is not None else past_key_values
        mask = key_mask(attention_mask, attention_mask.shape[-1]) if attention_mask is not None else None
        if mask is not None and not bool(mask[..., -1, :].all()):
            raise ValueError("attnsurg's linear attention does not take padded batches; run one sequence at a time")
        batch, length, _ = hidden_states.shape
        inputs = self.rotated(hidden_states, position_embeddings)
        layer = linear_cache_layer(cache if cache is not None else DynamicCache(), self.layer_idx, self.window)
        outputs = []
        for start in range(0, length, LINEAR_CHUNK):
            chunk = slice(start, min(start + LINEAR_CHUNK, length))
            outputs.append(self.chunk_step(layer, *(t[:, :, chunk] for t in inputs)))
        output = torch.cat(outputs, dim=2).to(hidden_states.dtype)
        return self.o_proj(output.transpose(1, 2).reshape(batch, length, -1)), None

    def chunk_step(self, layer: LinearStateLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   feature_query: torch.Tensor, feature_key: torch.Tensor) -> torch.Tensor:
        """New tokens against the sinks, the window before them and the state; keys that leave the window
        join the sinks or the state."""
        keys, values = layer.update(key, value)  # the window before these tokens, then these tokens
        first = layer.cumulative_length - keys.shape[2]  # the position of keys[:, :, 0]
        if query.shape[2] == 1:
            return self.decode_step(layer, query, keys, values, feature_query, first)
        leaving = max(keys.shape[2] - self.window, 0)  # the keys older than the window for the last query
        log_features = self.leaving_features(keys, feature_key, first, leaving)  # the only keys the maps read
        every_key, every_value, positions = layer.with_sinks(keys, values, first)
        held = every_key.shape[2] - keys.shape[2]  # sinks: exact only, their features never read
        key_features = torch.cat([log_features.new_full((*log_features.shape[:2], held, log_features.shape[3]),
                                                        float("-inf")), log_features], dim=2)
        decay = self.decay()
        output = hybrid_attention(query, every_key, every_value, self.query_features(feature_query), key_features,
                                  self.window, self.scaling, self.linear_scale, layer, self.sinks, positions,
                                  self.anchored, decay)
        if leaving:
            retire(layer, keys[:, :, :leaving], values[:, :, :leaving], log_features, first, self.sinks, decay)
        return output

    def leaving_features(self, keys: torch.Tensor, new_keys: torch.Tensor, first: int, leaving: int) -> torch.Tensor:
        """log phi(k) [B, G, leaving, 2F] of the first ``leaving`` of ``keys`` (the window's, the first at
        position ``first``, then the new ones, whose form the maps read is ``new_keys``)."""
        cached = keys.shape[2] - new_keys.shape[2]
        read = self.keys_read(keys[:, :, :min(leaving, cached)], first).float()
        if leaving > cached:
            read = torch.cat([read, new_keys[:, :, : leaving - cached].float()], dim=2)
        return self.key_features(read)

    def decode_step(self, layer: LinearStateLayer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    feature_query: torch.Tensor, first: int) -> torch.Tensor:
        """One new token: the key leaving the window joins the sinks or the state first (it is no longer in
        the window for this query), then softmax over the sinks and the window and the state under one
        normalisation (shifted as in hybrid_attention), each KV head's query heads together."""
        leaving, decay = keys.shape[2] - self.window, self.decay()
        if leaving > 0:
            log_features = self.key_features(self.keys_read(keys[:, :, :leaving], first))
            retire(layer, keys[:, :, :leaving], values[:, :, :leaving], log_features, first, self.sinks, decay)
            keys, values = keys[:, :, leaving:], values[:, :, leaving:]
        if layer.sink_keys is not None:
            keys, values = torch.cat([layer.sink_keys, keys], dim=2), torch.cat([layer.sink_values, values], dim=2)
        batch, heads, _, d = query.shape
        kv_heads = keys.shape[1]
        rows = (batch, kv_heads, heads // kv_heads)  # a KV head's query heads as the rows of one product
        q = query.float().reshape(*rows, d)
        scores = q @ keys.float().transpose(-1, -2) * self.scaling
        if layer.state is None:
            exact = torch.softmax(scores, dim=-1)
            return (exact @ values.float()).reshape(batch, heads, 1, d)
        position = layer.cumulative_length - 1  # this token's
        log_q = (self.query_features(feature_query).reshape(*rows, -1) + layer.shift_at(position, decay)[:, :, None]
                 + self.linear_scale.float().reshape(1, *rows[1:], 1))
        exact, features = shifted_weights(scores, log_q, self.anchored)
        numerator = exact @ values.float() + features @ layer.state
        denominator = exact.sum(-1, keepdim=True) + features @ layer.normalizer[..., None]
        return (numerator / denominator).reshape(batch, heads, 1, d)


def apply_surgery(model: nn.Module, surgery: dict) -> None:
    """Replace the modules that ``surgery`` (``config.attnsurg``) names with their factorized forms."""
    layers = model.model.layers
    old_attention = {id(layer): layer.self_attn for layer in layers}  # their q/k norms (Qwen3) stay
    for index, rank in (surgery.get("kv_latent") or {}).items():
        layer = layers[int(index)]
        old = layer.self_attn
        layer.self_attn = LatentKVAttention(
            model.config, int(index), int(rank), old.k_proj.bias is not None, old.q_proj, old.o_proj
        )
    for path, rank in (surgery.get("low_rank") or {}).items():
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        old = getattr(parent, name)
        setattr(parent, name, LowRankLinear(old.in_features, old.out_features, int(rank), old.bias is not None))
    for path, spec in (surgery.get("head_tensor") or {}).items():
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, name, head_tensor_projection(getattr(parent, name), spec))
    loki = surgery.get("loki")
    if loki:
        for index, layer in enumerate(layers):
            old = layer.self_attn
            rank = loki["rank"][index] if isinstance(loki["rank"], list) else loki["rank"]  # per layer or one
            layer.self_attn = LokiAttention(model.config, index, old.q_proj, old.k_proj, old.v_proj, old.o_proj,
                                            int(rank), loki["top_k"])
    linear = surgery.get("linear")
    if linear:
        full = {int(index) for index in linear.get("full_layers", ())}  # softmax over the whole context, unchanged
        for index, layer in enumerate(layers):
            if index in full:
                continue
            old = layer.self_attn
            layer.self_attn = HybridLinearAttention(model.config, index, old.q_proj, old.k_proj, old.v_proj, old.o_proj,
                                                    int(linear["window"]), int(linear["feature_dim"]),
                                                    int(linear.get("sinks", 0)), linear.get("feature_map", "hedgehog"),
                                                    bool(linear.get("decay", False)),
                                                    bool(linear.get("features_before_rope", False)))
    for index, spec in (surgery.get("stacked_tucker") or {}).items():
        layer = layers[int(index)]
        old = layer.self_attn
        biases = {name: getattr(old, f"{name}_proj").bias is not None for name in "qkvo"}
        layer.self_attn = StackedTuckerAttention(model.config, int(index), spec["ranks"], spec["cache_latent"], biases)
    for index in surgery.get("factored_kv") or {}:
        layer = layers[int(index)]
        old = layer.self_attn
        layer.self_attn = FactoredKVAttention(model.config, int(index), old.q_proj, old.k_proj, old.v_proj, old.o_proj)
    for layer in layers:
        if isinstance(layer.self_attn, AttentionBase) and layer.self_attn.q_norm is None:
            layer.self_attn.carry_norms(old_attention[id(layer)])
    link_rotary(model)


def head_tensor_projection(old: nn.Module, spec: dict) -> HeadTensorProjection:
    """The Tucker or CP module that replaces ``old`` (an nn.Linear) as ``spec`` describes."""
    heads, head_dim, heads_on = int(spec["heads"]), int(spec["head_dim"]), spec["heads_on"]
    hidden = old.in_features if heads_on == "output" else old.out_features
    bias = old.bias is not None
    if spec["kind"] == "tucker":
        return TuckerProjection(hidden, heads, head_dim, [int(r) for r in spec["ranks"]], heads_on, bias)
    return CPProjection(hidden, heads, head_dim, int(spec["rank"]), heads_on, bias)


def layer_rotary(rotary: nn.Module, config, layer_idx: int) -> Callable:
    """The rotary embedding layer ``layer_idx`` rotates with, (x, positions) -> (cos, sin): Gemma 3's bound to the
    layer's type (its sliding layers have their own base)."""
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        return rotary
    return functools.partial(rotary, layer_type=config.layer_types[layer_idx])


def link_rotary(model: nn.Module) -> None:
    """Give each rebuilt-KV or hybrid linear attention its layer's rotary embedding without registering it twice."""
    for index, layer in enumerate(model.model.layers):
        if isinstance(layer.self_attn, (RebuiltKVAttention, HybridLinearAttention)):
            object.__setattr__(layer.self_attn, "rotary", layer_rotary(model.model.rotary_emb, model.config, index))


class SurgeryMixin:
    """Builds the family's model, then rebuilds the modules that ``config.attnsurg`` names."""

    def __init__(self, config) -> None:
        super().__init__(config)
        apply_surgery(self, config.attnsurg or {})


class AttnsurgLlamaConfig(LlamaConfig):
    model_type = "attnsurg_llama"
    attnsurg: dict | None = None


class AttnsurgLlamaForCausalLM(SurgeryMixin, LlamaForCausalLM):
    config_class = AttnsurgLlamaConfig


class AttnsurgMistralConfig(MistralConfig):
    model_type = "attnsurg_mistral"
    attnsurg: dict | None = None


class AttnsurgMistralForCausalLM(SurgeryMixin, MistralForCausalLM):
    config_class = AttnsurgMistralConfig


class AttnsurgQwen2Config(Qwen2Config):
    model_type = "attnsurg_qwen2"
    attnsurg: dict | None = None


class AttnsurgQwen2ForCausalLM(SurgeryMixin, Qwen2ForCausalLM):
    config_class = AttnsurgQwen2Config


class AttnsurgQwen3Config(Qwen3Config):
    model_type = "attnsurg_qwen3"
    attnsurg: dict | None = None


class AttnsurgQwen3ForCausalLM(SurgeryMixin, Qwen3ForCausalLM):
    config_class = AttnsurgQwen3Config


class AttnsurgGemma2Config(Gemma2Config):
    model_type = "attnsurg_gemma2"
    attnsurg: dict | None = None


class AttnsurgGemma2ForCausalLM(SurgeryMixin, Gemma2ForCausalLM):
    config_class = AttnsurgGemma2Config


class AttnsurgGemma3TextConfig(Gemma3TextConfig):
    model_type = "attnsurg_gemma3_text"
    attnsurg: dict | None = None


class AttnsurgGemma3ForCausalLM(SurgeryMixin, Gemma3ForCausalLM):
    config_class = AttnsurgGemma3TextConfig


# model_type of the base family -> (config class, model class) of its attnsurg form
CLASSES = {
    "llama": (AttnsurgLlamaConfig, AttnsurgLlamaForCausalLM),
    "mistral": (AttnsurgMistralConfig, AttnsurgMistralForCausalLM),
    "qwen2": (AttnsurgQwen2Config, AttnsurgQwen2ForCausalLM),
    "qwen3": (AttnsurgQwen3Config, AttnsurgQwen3ForCausalLM),
    "gemma2": (AttnsurgGemma2Config, AttnsurgGemma2ForCausalLM),
    "gemma3_text": (AttnsurgGemma3TextConfig, AttnsurgGemma3ForCausalLM),
}
