"""Families with fused projections, rewritten on load as the family they equal with the projections split.

Phi-3 is Mistral with q, k and v in one ``qkv_proj`` (rows: the H query heads, then the G key heads, then the
G value heads) and the MLP's gate and up in one ``gate_up_proj`` (gate rows first), with the same norms,
residual adds, RoPE and sliding window. Splitting the rows gives a Mistral model whose logits are the same
(tested), so every method operates on the split form; the output is written as that family (an attnsurg
Mistral checkpoint, or DeepseekV3 after MLA).
"""

from __future__ import annotations

import torch
from transformers import MistralConfig, MistralForCausalLM, PretrainedConfig, PreTrainedModel

from attnsurg.errors import UserError

UNFUSED_AS = {"phi3": "mistral"}
SHARED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
                 "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "sliding_window", "attention_dropout",
                 "bos_token_id", "eos_token_id", "pad_token_id", "dtype")


def unfused_config(config: PretrainedConfig) -> MistralConfig:
    """The Mistral config a Phi-3 config equals once its projections are split; refused where it does not."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError(f"this Phi-3 model rotates only part of each head (partial_rotary_factor "
                        f"{rope['partial_rotary_factor']}), which attnsurg does not support yet")
    fields = {name: getattr(config, name) for name in SHARED_FIELDS if getattr(config, name, None) is not None}
    if rope.get("rope_type") == "longrope":  # its attention factor is computed from the original context
        rope.setdefault("original_max_position_embeddings", config.original_max_position_embeddings)
    fields["rope_parameters"] = rope
    return MistralConfig(**fields)


FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def split_widths(config: PretrainedConfig) -> dict[str, list[int]]:
    """The row counts each fused tensor splits into, for the unfused config."""
    H, G = config.num_attention_heads, config.num_key_value_heads
    d = config.head_dim or config.hidden_size // H
    return {"self_attn.qkv_proj.weight": [H * d, G * d, G * d],
            "mlp.gate_up_proj.weight": [config.intermediate_size, config.intermediate_size]}


def fused_suffix(name: str) -> str | None:
    return next((suffix for suffix in FUSED if name.endswith(suffix)), None)


def unfused_names(name: str) -> tuple[str, ...]:
    """The names a stored tensor has once unfused: a fused one's parts, any other its own."""
    fused = fused_suffix(name)
    return (name,) if fused is None else tuple(name.removesuffix(fused) + part for part in FUSED[fused])


def unfused_tensors(name: str, tensor: torch.Tensor, widths: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """A stored tensor under the unfused names: a fused one split by rows, any other as it is."""
    fused = fused_suffix(name)
    pieces = (tensor,) if fused is None else tensor.split(widths[fused])
    return dict(zip(unfused_names(name), pieces, strict=True))


class UnfusedReader:
    """A fused-projection checkpoint (Phi-3) read one tensor at a time as the family it equals: each fused
    tensor split on read, so a layer-by-layer surgery reads it as it reads a Mistral checkpoint."""

    def __init__(self, reader, config: PretrainedConfig):
        self.reader, self.path = reader, reader.path
        self.widths = split_widths(unfused_config(config))
        self.fused_of = {part: name for name in reader.weight_map for part in unfused_names(name)}
        self.weight_map = {part: reader.weight_map[name] for part, name in self.fused_of.items()}

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        fused = self.fused_of.get(name, name)
        return unfused_tensors(fused, self.reader.tensor(fused, dtype), self.widths)[name]

    def state(self, prefix: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        state = {}
        for name, tensor in self.reader.state(prefix, dtype).items():
            state |= unfused_tensors(name, tensor, self.widths)
        return state


@torch.no_grad()
def unfused_model(model: PreTrainedModel) -> PreTrainedModel:
    """A fused-projection model (Phi-3) as the family it equals with split projections; other models as they are."""
    if model.config.model_type not in UNFUSED_AS:
        return model
    config = unfused_config(model.config)
    widths = split_widths(config)
    state = {}
    for name, tensor in model.state_dict().items():
        state |= unfused_tensors(name, tensor, widths)
    with torch.device("meta"):
        target = MistralForCausalLM(config)
    target.load_state_dict(state, assign=True, strict=not config.tie_word_embeddings)
    target.model.rotary_emb = type(target.model.rotary_emb)(config)  # its buffers are not in the state dict
    if config.tie_word_embeddings:
        target.tie_weights()
    target.generation_config = model.generation_config
    return target.to(model.dtype).eval()
