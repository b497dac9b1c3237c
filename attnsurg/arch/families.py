"""What attnsurg knows about each model family: small, data-like adapters.

A family adapter names where the attention projections live. Everything numeric (head counts, RoPE,
biases) is read from the config and the instantiated modules by :mod:`attnsurg.arch.anatomy`, so an
adapter stays a few lines long.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from attnsurg.errors import UserError


@dataclass(frozen=True)
class Family:
    """Where a family keeps its attention, and what it is called."""

    model_type: str
    label: str
    layers_path: str = "model.layers"
    rotary_path: str = "model.rotary_emb"
    attention_attr: str = "self_attn"
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"
    mlp: str = "mlp"
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"

    def layer_rotary(self, model, index: int) -> Callable:
        """The rotary embedding layer ``index`` rotates with, (x, positions) -> (cos, sin) (Gemma 3: per type)."""
        from attnsurg.modeling.modeling_attnsurg import layer_rotary

        return layer_rotary(model.get_submodule(self.rotary_path), model.config, index)


# Families whose attention attnsurg can operate on. SmolLM checkpoints are model_type "llama".
SURGERY_FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "Llama / SmolLM"),
        Family("mistral", "Mistral"),
        Family("qwen2", "Qwen2"),
        Family("qwen3", "Qwen3"),
        Family("phi3", "Phi-3 (fused projections split on load, as Mistral)"),
        Family("gemma2", "Gemma 2 (every method but MLA)"),
        Family("gemma3_text", "Gemma 3 text (every method but MLA)"),
    )
}

# Families attnsurg writes and can therefore read back and measure (never operate on again).
OUTPUT_FAMILIES: dict[str, Family] = {
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3 (multi-head latent attention)"),
}


# Families whose decoder layers are Llama-like: one RoPE, one causal mask and plain pre-norms around attention
# and MLP. MLA writes such layers (DeepseekV3's), and the layer-streaming path runs each layer that way. Gemma's
# layers (their own norms, scaled embeddings, per-type RoPE and masks) are not; attnsurg's replacing attentions
# keep Gemma's query scale, soft-capping and windows themselves.
LLAMA_LIKE_LAYERS = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def llama_like_reason(anatomy, what: str) -> str | None:
    """Why ``what`` (which writes or runs Llama-like decoder layers) cannot take this family, or None."""
    if anatomy.model_type in LLAMA_LIKE_LAYERS:
        return None
    return (f"{what} writes Llama-like DeepseekV3 decoder layers, and {anatomy.model_type}'s are not (its own query "
            "scale, soft-capping, norms around attention and MLP, scaled embeddings); every other method keeps them")


def supported_names() -> str:
    return ", ".join(f"{f.label} ({f.model_type})" for f in SURGERY_FAMILIES.values())


def blocking_features(anatomy) -> str:
    """What in an unsupported family's attention attnsurg does not handle yet, in words."""
    features = ["attention logit soft-capping"] if anatomy.logit_softcap else []
    if anatomy.qk_norm:
        features.append("per-head q/k norms")
    if anatomy.sliding_window:
        features.append(f"sliding-window layers ({anatomy.sliding_layers} of {anatomy.num_layers})")
    return ", ".join(features) or "its attention module layout"


def family_for_surgery(model_type: str) -> Family:
    """The adapter for a model that a surgery method will modify; a clear error otherwise."""
    family = SURGERY_FAMILIES.get(model_type)
    if family is None:
        raise UserError(
            f"model type '{model_type}' is not supported for attention surgery; supported: {supported_names()}"
        )
    return family
