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


@torch.no_grad()
def unfused_model(model: PreTrainedModel) -> PreTrainedModel:
    """A fused-projection model (Phi-3) as the family it equals with split projections; other models as they are."""
    if model.config.model_type not in UNFUSED_AS:
        return model
    config = unfused_config(model.config)
    H, G = config.num_attention_heads, config.num_key_value_heads
    d = config.head_dim or config.hidden_size // H
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("self_attn.qkv_proj.weight"):
            q, k, v = tensor.split([H * d, G * d, G * d])
            prefix = name.removesuffix("qkv_proj.weight")
            state |= {prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v}
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            prefix = name.removesuffix("gate_up_proj.weight")
            state |= {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up}
        else:
            state[name] = tensor
    with torch.device("meta"):
        target = MistralForCausalLM(config)
    target.load_state_dict(state, assign=True, strict=not config.tie_word_embeddings)
    target.model.rotary_emb = type(target.model.rotary_emb)(config)  # its buffers are not in the state dict
    if config.tie_word_embeddings:
        target.tie_weights()
    target.generation_config = model.generation_config
    return target.to(model.dtype).eval()
