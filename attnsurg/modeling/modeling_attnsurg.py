"""Modeling code for checkpoints written by ``attnsurg compress`` (low-rank attention projections).

This file is self-contained (torch and transformers only): attnsurg copies it into every checkpoint it
writes, where ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` finds it through the
config's ``auto_map``; attnsurg itself registers the same classes and loads such checkpoints without
remote code.

A checkpoint keeps its family's architecture and records its surgery in ``config.attnsurg``:

- ``low_rank``: module path -> rank. That ``nn.Linear`` becomes :class:`LowRankLinear` (``down``: in -> r,
  ``up``: r -> out, with the original bias), so the factors, not a dense product, are what is stored.
- ``kv_latent``: layer index -> rank. That layer's k/v projections become one shared down projection to an
  r-dimensional latent and one up projection to [K; V] (:class:`LatentKVAttention`). The cache holds the
  latent, not K and V; keys are rebuilt from it and rotated afterwards (Palu, Chang et al. 2024, sec. 3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout of the Llama family; cos/sin: ``[batch, seq, head_dim]``."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class LatentKVAttention(nn.Module):
    """Attention whose cache holds one latent per token for K and V together.

    ``kv_down`` maps the input to the latent c (width r, cached); ``kv_up`` maps c to [K; V] (rows: the G
    key heads, then the G value heads), so K and V are rebuilt from the cache at every step and RoPE is
    applied to the rebuilt keys. Rotations are relative, so key positions are counted from the start of the
    cache and query positions continue them; left padding shifts both alike and changes no score.
    """

    def __init__(self, config, layer_idx: int, rank: int, kv_bias: bool, q_proj: nn.Module, o_proj: nn.Module):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.q_proj = q_proj
        self.o_proj = o_proj
        self.kv_down = nn.Linear(config.hidden_size, rank, bias=False)
        self.kv_up = nn.Linear(rank, 2 * self.num_key_value_heads * self.head_dim, bias=kv_bias)
        self.rotary: Callable | None = None  # the model's rotary embedding, set by the model (not a submodule)

    @property
    def latent_rank(self) -> int:
        return self.kv_down.out_features

    def cached_latent(self, latent: torch.Tensor, cache) -> torch.Tensor:
        """Append this step's latent to the cache (split over its key and value slots) and return it all."""
        if cache is None:
            return latent
        half = (latent.shape[-1] + 1) // 2
        first, second = cache.update(latent[..., :half].unsqueeze(1), latent[..., half:].unsqueeze(1), self.layer_idx)
        return torch.cat([first, second], dim=-1).squeeze(1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, _ = hidden_states.shape
        G, d = self.num_key_value_heads, self.head_dim
        query = self.q_proj(hidden_states).view(batch, length, -1, d).transpose(1, 2)
        latent = self.cached_latent(self.kv_down(hidden_states), cache if cache is not None else past_key_values)
        total = latent.shape[1]
        kv = self.kv_up(latent).view(batch, total, 2, G, d)
        key, value = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

        positions = torch.arange(total, device=hidden_states.device).unsqueeze(0)
        cos, sin = self.rotary(value, positions)
        key = apply_rope(key, cos, sin)
        query = apply_rope(query, cos[:, total - length :], sin[:, total - length :])

        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(output.reshape(batch, length, -1).contiguous()), weights


def apply_surgery(model: nn.Module, surgery: dict) -> None:
    """Replace the modules that ``surgery`` (``config.attnsurg``) names with their factorized forms."""
    layers = model.model.layers
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
    link_rotary(model)


def link_rotary(model: nn.Module) -> None:
    """Give each latent attention the model's rotary embedding without registering it twice."""
    for layer in model.model.layers:
        if isinstance(layer.self_attn, LatentKVAttention):
            object.__setattr__(layer.self_attn, "rotary", model.model.rotary_emb)


class AttnsurgLlamaConfig(LlamaConfig):
    model_type = "attnsurg_llama"
    attnsurg: dict | None = None


class AttnsurgLlamaForCausalLM(LlamaForCausalLM):
    config_class = AttnsurgLlamaConfig

    def __init__(self, config: AttnsurgLlamaConfig) -> None:
        super().__init__(config)
        apply_surgery(self, config.attnsurg or {})


class AttnsurgMistralConfig(MistralConfig):
    model_type = "attnsurg_mistral"
    attnsurg: dict | None = None


class AttnsurgMistralForCausalLM(MistralForCausalLM):
    config_class = AttnsurgMistralConfig

    def __init__(self, config: AttnsurgMistralConfig) -> None:
        super().__init__(config)
        apply_surgery(self, config.attnsurg or {})


class AttnsurgQwen2Config(Qwen2Config):
    model_type = "attnsurg_qwen2"
    attnsurg: dict | None = None


class AttnsurgQwen2ForCausalLM(Qwen2ForCausalLM):
    config_class = AttnsurgQwen2Config

    def __init__(self, config: AttnsurgQwen2Config) -> None:
        super().__init__(config)
        apply_surgery(self, config.attnsurg or {})


# model_type of the base family -> (config class, model class) of its attnsurg form
CLASSES = {
    "llama": (AttnsurgLlamaConfig, AttnsurgLlamaForCausalLM),
    "mistral": (AttnsurgMistralConfig, AttnsurgMistralForCausalLM),
    "qwen2": (AttnsurgQwen2Config, AttnsurgQwen2ForCausalLM),
}
