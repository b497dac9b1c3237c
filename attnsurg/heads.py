"""A source attention layer recomputed head by head from its input: per-head queries, keys and values, its
causal softmax attention, and how much of that attention each token receives."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from attnsurg.calibrate import visible_keys


def head_projections(attention: nn.Module, hidden: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Queries, keys and values per head ([heads, L, d], float32) from one window's attention input ([1, L, D]),
    and the queries and keys after RoPE (queries and keys through the layer's q/k norms where it has them, Qwen3
    and Gemma 3)."""
    weight = attention.q_proj.weight
    x, d = hidden[0].to(weight.dtype), attention.head_dim
    length = x.shape[0]

    def heads(projection: nn.Module) -> torch.Tensor:
        return projection(x).view(length, -1, d).transpose(0, 1)

    query, key = heads(attention.q_proj), heads(attention.k_proj)
    if getattr(attention, "q_norm", None) is not None:
        query, key = attention.q_norm(query), attention.k_norm(key)
    query, key, value = query.float(), key.float(), heads(attention.v_proj).float()
    cos, sin = (part.float() for part in rope)
    query_post, key_post = apply_rotary_pos_emb(query[None], key[None], cos, sin)
    return query, key, value, query_post[0], key_post[0]


def softmax_scale(attention: nn.Module) -> float:
    """The factor on q . k: the module's own (Gemma's query_pre_attn_scalar), else head_dim^-1/2."""
    return getattr(attention, "scaling", attention.head_dim ** -0.5)


def attention_probabilities(query: torch.Tensor, key: torch.Tensor, scale: float, window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Causal softmax attention [..., L, L] from post-RoPE queries [..., L, d] and keys [..., L, d] (keys already
    repeated to the query heads), in the inputs' dtype; a sliding layer's ``window`` and Gemma 2's ``softcap``
    as the layer applies them."""
    scores = (query @ key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores.masked_fill(~visible_keys(query.shape[-2], window, scores.device), float("-inf")), dim=-1)


def layer_masking(attention: nn.Module) -> dict:
    """The window and soft-cap a family's attention module applies (Gemma's, Mistral's and Phi-3's windows, Gemma
    2's soft-cap), read from its config as attnsurg's own attention reads them, as keyword arguments."""
    from attnsurg.modeling.modeling_attnsurg import layer_window

    config = attention.config
    return {"window": layer_window(config, attention.layer_idx), "softcap": getattr(config, "attn_logit_softcapping", None)}


@torch.no_grad()
def received_attention(attention: nn.Module, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[n, L]: the attention each token of each window ([n, L, D] attention input) receives from the queries
    that see it, summed over those queries and averaged over the query heads; its mean over a window is 1.
    Computed one KV group at a time, so memory holds one group's [heads, L, L] probabilities."""
    scale, masking = softmax_scale(attention), layer_masking(attention)
    received = []
    for window in hidden:
        _, _, _, query, key = head_projections(attention, window[None], rope)
        heads, groups = query.shape[0], key.shape[0]
        per_group = heads // groups
        total = torch.zeros(query.shape[1], device=query.device)
        for g in range(groups):
            queries = query[g * per_group : (g + 1) * per_group]
            total += attention_probabilities(queries, key[g : g + 1].expand_as(queries), scale, **masking).sum(dim=(0, 1))
        received.append(total / heads)
    return torch.stack(received)
