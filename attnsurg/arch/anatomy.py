"""Read a model's attention anatomy from its config, without loading any weights.

The model is instantiated on the ``meta`` device, so the biases, norms and parameter counts come from
the very modules transformers would build, not from a second copy of its rules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from attnsurg.arch.families import OUTPUT_FAMILIES, SURGERY_FAMILIES
from attnsurg.errors import UserError

BYTES_PER_DTYPE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class AttentionAnatomy:
    """The attention of one checkpoint, as numbers and flags."""

    model_type: str
    family: str | None
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_kind: str
    rope_type: str | None
    rope_theta: float | None
    q_bias: bool
    k_bias: bool
    v_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None
    sliding_layers: int
    max_positions: int | None
    tied_embeddings: bool
    dtype: str
    kv_values_per_layer: int
    attention_parameters: int
    total_parameters: int
    mla: dict[str, int] = field(default_factory=dict)
    kv_layer_values: tuple[int, ...] = ()  # per layer, where layers differ (low-rank k/v latents)
    surgery: dict = field(default_factory=dict)  # config.attnsurg of a checkpoint attnsurg wrote
    fused_qkv: bool = False  # q, k and v in one projection (Phi-3)
    logit_softcap: float | None = None  # attention scores soft-capped at this value (Gemma 2)

    @property
    def kv_values_per_token(self) -> int:
        return sum(self.kv_layer_values) or self.num_layers * self.kv_values_per_layer

    def kv_bytes_per_token(self, dtype: str | None = None, context: int | None = None) -> int:
        """Cache bytes per token; at ``context`` tokens, those the cache holds then over the tokens (a fixed-size
        cache, hybrid linear attention's, holds fewer per token the longer the context)."""
        values = self.kv_values_per_token if context is None else self.cache_values(context) / context
        return round(values * BYTES_PER_DTYPE[dtype or self.dtype])

    def cache_values(self, context: int) -> int:
        """Values the cache holds at ``context`` tokens, all layers."""
        linear = self.surgery.get("linear")
        if linear:
            full = len(linear.get("full_layers", ()))
            hybrid = linear_cache_values(self.num_kv_heads, self.head_dim, int(linear["window"]),
                                         int(linear["feature_dim"]), context, int(linear.get("sinks", 0)))
            return (self.num_layers - full) * hybrid + full * self.kv_values_per_layer * context
        return self.kv_values_per_token * context

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["kv_values_per_token"] = self.kv_values_per_token
        record["kv_bytes_per_token"] = self.kv_bytes_per_token()
        record["kv_bytes_per_token_bf16"] = self.kv_bytes_per_token("bfloat16")
        return record


def linear_cache_values(kv_heads: int, head_dim: int, window: int, feature_dim: int, context: int,
                        sinks: int = 0) -> int:
    """One hybrid linear layer's cache at ``context`` tokens: the window's and the sinks' keys and values, and
    the state S = sum phi(k) v^T and z = sum phi(k) of the other older keys with their shift (2F x (d + 2) per
    KV head)."""
    exact = min(context, window + sinks)
    return 2 * kv_heads * head_dim * exact + kv_heads * 2 * feature_dim * (head_dim + 2)


def config_dtype(config: PretrainedConfig) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    return dtype if dtype in BYTES_PER_DTYPE else "float32"


def rope_settings(config: PretrainedConfig) -> tuple[str | None, float | None]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and "rope_type" not in params and params:
        # Per-layer-type RoPE (e.g. {"full_attention": {...}}): report the first.
        params = next(iter(params.values())) if isinstance(next(iter(params.values())), dict) else params
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    rope_type = params.get("rope_type", params.get("type", "default" if theta is not None else None))
    return rope_type, (float(theta) if theta is not None else None)


def sliding_attention(config: PretrainedConfig, num_layers: int) -> tuple[int | None, int]:
    """The sliding window and how many layers use it."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None, 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window, sum(t == "sliding_attention" for t in layer_types)
    if getattr(config, "use_sliding_window", True) is False:
        return None, 0
    return window, num_layers


def meta_model(config: PretrainedConfig, trust_remote_code: bool = False) -> nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def first_attention(model: nn.Module) -> nn.Module:
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            return module
    raise UserError(f"'{model.config.model_type}' has no self-attention layers (self_attn) for attnsurg to read; "
                    "it works on transformer decoders")


SIZES = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")


def check_sizes(config: PretrainedConfig) -> None:
    """One line for a config whose sizes no model can have (zero heads, heads that do not share out evenly)."""
    for name in (*SIZES, "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings"):
        value = getattr(config, name, None)
        if value is None and name not in SIZES:
            continue
        if value is None:
            raise UserError(f"the model's config has no {name}: attnsurg works on transformer decoders with self-attention")
        if not isinstance(value, int) or value <= 0:
            raise UserError(f"the model's config: {name} is {value!r}; it must be a positive integer")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads is not None and heads % kv_heads:
        raise UserError(f"the model's config: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if getattr(config, "head_dim", None) is None and config.hidden_size % heads:
        raise UserError(f"the model's config: hidden_size {config.hidden_size} does not split into {heads} heads; set head_dim")
    check_rope_types(config)


def rope_types(config: PretrainedConfig) -> list[str]:
    """Every RoPE type the config names: one, or one per layer type (Gemma 3's ``rope_parameters``)."""
    found = []
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        candidates = params.values() if isinstance(params, dict) and "rope_type" not in params and "type" not in params else [params]
        found += [str(p.get("rope_type", p.get("type"))) for p in candidates if isinstance(p, dict) and
                  (p.get("rope_type") or p.get("type"))]
    return found


def check_rope_types(config: PretrainedConfig) -> None:
    known = {"default", *ROPE_INIT_FUNCTIONS}
    for kind in rope_types(config):
        if kind not in known:
            raise UserError(f"the model's config names RoPE type '{kind}', which transformers does not know; use one of "
                            f"{', '.join(sorted(known))}")


def attention_parameters(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
    return total


def _has_bias(attn: nn.Module, name: str) -> bool:
    linear = getattr(attn, name, None)
    return getattr(linear, "bias", None) is not None


def mla_settings(config: PretrainedConfig) -> dict[str, int]:
    keys = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    return {k: int(getattr(config, k)) for k in keys}


def latent_kv_values(config: PretrainedConfig, num_layers: int, dense_values: int) -> tuple[int, ...]:
    """Per layer cached values of an attnsurg checkpoint that caches k/v latents or factors; else ()."""
    surgery = getattr(config, "attnsurg", None) or {}
    latent = dict(surgery.get("kv_latent") or {})
    latent.update({layer: sum(ranks) for layer, ranks in (surgery.get("factored_kv") or {}).items()})
    latent.update({layer: spec["ranks"][1] for layer, spec in (surgery.get("stacked_tucker") or {}).items()
                   if spec["cache_latent"]})
    if not latent:
        return ()
    return tuple(int(latent.get(str(i), dense_values)) for i in range(num_layers))


def inspect_config(config: PretrainedConfig, trust_remote_code: bool = False) -> AttentionAnatomy:
    """Build the anatomy of a causal LM from its config (no weights are read)."""
    model = meta_model(config, trust_remote_code=trust_remote_code)
    attn = first_attention(model)
    num_layers = int(config.num_hidden_layers)
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    rope_type, rope_theta = rope_settings(config)
    window, sliding_layers = sliding_attention(config, num_layers)
    mla: dict[str, int] = {}
    if getattr(config, "kv_lora_rank", None):
        mla = mla_settings(config)
        kind = "mla"
        kv_values = mla["kv_lora_rank"] + mla["qk_rope_head_dim"]
        head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        q_bias, k_bias, v_bias = False, _has_bias(attn, "kv_a_proj_with_mqa"), False
    else:
        kind = "mha" if num_kv_heads == num_heads else ("mqa" if num_kv_heads == 1 else "gqa")
        kv_values = 2 * num_kv_heads * head_dim
        q_bias, k_bias, v_bias = (_has_bias(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    layer_values = latent_kv_values(config, num_layers, kv_values)
    if layer_values:
        kind += "+latent"
        kv_values = round(sum(layer_values) / num_layers)
    model_type = config.model_type
    family = model_type if model_type in SURGERY_FAMILIES or model_type in OUTPUT_FAMILIES else None
    return AttentionAnatomy(
        model_type=model_type,
        family=family,
        num_layers=num_layers,
        hidden_size=int(config.hidden_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        attention_kind=kind,
        rope_type=rope_type,
        rope_theta=rope_theta,
        q_bias=q_bias,
        k_bias=k_bias,
        v_bias=v_bias,
        o_bias=_has_bias(attn, "o_proj"),
        qk_norm=any(getattr(attn, n, None) is not None for n in ("q_norm", "k_norm")),
        sliding_window=window,
        sliding_layers=sliding_layers,
        max_positions=getattr(config, "max_position_embeddings", None),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        dtype=config_dtype(config),
        kv_values_per_layer=kv_values,
        attention_parameters=attention_parameters(model),
        total_parameters=count_parameters(model),
        mla=mla,
        kv_layer_values=layer_values,
        surgery=dict(getattr(config, "attnsurg", None) or {}),
        fused_qkv=hasattr(attn, "qkv_proj"),
        logit_softcap=getattr(config, "attn_logit_softcapping", None),
    )
