"""A stock DeepseekV3 model (config and weights) from the fitted layers."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PretrainedConfig, PreTrainedModel

from attnsurg.arch.families import Family
from attnsurg.methods.factorized import load_complete_state
from attnsurg.methods.mla.fit import NORM_CONSTANT, MLAWeights, rope_frequencies
from attnsurg.methods.mla.plan import MLAPlan

if TYPE_CHECKING:
    from attnsurg.methods.base import LayerTensors


# ----------------------------------------------------------------------------------- the model
def flexible_rope_parameters(plan: MLAPlan, inv_freq: torch.Tensor, theta: float, max_positions: int) -> dict:
    """transformers' longrope type with one factor per pair expresses any frequency list:
    inv_freq_m = 1 / (factor_m * theta^(2m/R)); equal short and long factors and attention_factor 1."""
    R = plan.rope_dim
    factors = [1.0 / (w * theta ** (2 * m / R)) for m, w in enumerate(rope_frequencies(plan, inv_freq))]
    return {
        "rope_type": "longrope",
        "rope_theta": theta,
        "short_factor": factors,
        "long_factor": factors,
        "factor": 1.0,
        "attention_factor": 1.0,
        "original_max_position_embeddings": max_positions,
    }


def deepseek_config(source: PreTrainedModel | PretrainedConfig, plan: MLAPlan, inv_freq: torch.Tensor | None = None,
                    ) -> DeepseekV3Config:
    """A complete DeepseekV3 config for a source model (or its config: the dtype is then the config's): every
    MLP dense, no q LoRA, interleaved RoPE at the kept frequencies.

    Standard layout: the R/2 highest frequencies, by rope_theta = theta^(R/d), or with a fold f every f-th
    from the highest, by theta^(f R/d) (every engine reads it).
    Flexible layout: any frequency list, repeats included, through longrope per-pair factors."""
    c = source if isinstance(source, PretrainedConfig) else source.config
    dtype = c.dtype if isinstance(source, PretrainedConfig) else source.dtype
    rope = dict(c.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    if plan.layout == "flexible":
        rope = flexible_rope_parameters(plan, inv_freq, float(rope["rope_theta"]), c.max_position_embeddings)
    else:
        rope["rope_theta"] = float(rope["rope_theta"]) ** (plan.rope_fold * plan.rope_dim / plan.head_dim)
    return DeepseekV3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=plan.num_heads,
        num_key_value_heads=plan.num_heads,
        n_shared_experts=1,
        n_routed_experts=2,  # unused (every layer dense); llama.cpp asserts n_group < n_routed_experts
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=c.num_hidden_layers,
        kv_lora_rank=plan.latent_width,
        q_lora_rank=c.hidden_size + 1 if plan.query_route else None,
        qk_rope_head_dim=plan.rope_dim,
        qk_nope_head_dim=plan.written_dims[0],
        v_head_dim=plan.written_dims[1],
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=plan.exact,
        attention_dropout=0.0,
        tie_word_embeddings=c.tie_word_embeddings and plan.engine != "vllm",  # vLLM's DeepSeek never ties lm_head
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=getattr(c, "pad_token_id", None),
        dtype=str(dtype or "float32").removeprefix("torch."),
        architectures=[DeepseekV3ForCausalLM.__name__],  # engines (vLLM, SGLang, TGI) dispatch on it
    )


def query_route_state(w: MLAWeights) -> dict[str, torch.Tensor]:
    """q_a = [I; 0] with bias [0; C]: the norm divides by ~C / sqrt(D + 1) for every token (relative error
    |x|^2 / 2C^2); its weight undoes that on x and maps the constant channel to exactly 1, and q_b's column for
    that channel is the query bias."""
    hidden = w.q_proj.shape[1]
    q_a = torch.cat([torch.eye(hidden, dtype=torch.float64), torch.zeros(1, hidden, dtype=torch.float64)])
    q_a_bias = torch.zeros(hidden + 1, dtype=torch.float64)
    q_a_bias[-1] = NORM_CONSTANT
    rms = NORM_CONSTANT / math.sqrt(hidden + 1)
    norm = torch.full((hidden + 1,), rms, dtype=torch.float64)
    norm[-1] = 1 / math.sqrt(hidden + 1)
    return {
        "q_a_proj.weight": q_a,
        "q_a_proj.bias": q_a_bias,
        "q_a_layernorm.weight": norm,
        "q_b_proj.weight": torch.cat([w.q_proj, w.q_bias[:, None]], dim=1),
    }


def attention_state(w: MLAWeights, o_weight: torch.Tensor, query_route: bool) -> dict[str, torch.Tensor]:
    """The state dict of one DeepseekV3 attention module holding a converted layer (no biases when the
    weights have none: the native format)."""
    state = query_route_state(w) if query_route else {"q_proj.weight": w.q_proj}
    state.update({
        "kv_a_proj_with_mqa.weight": w.kv_a_weight,
        "kv_a_layernorm.weight": w.kv_a_norm,
        "kv_b_proj.weight": w.kv_b_proj,
        "o_proj.weight": o_weight,
    })
    if w.kv_a_bias is not None:
        state.update({"kv_a_proj_with_mqa.bias": w.kv_a_bias, "o_proj.bias": w.o_bias})
    return state


def padded_heads(w: MLAWeights, o_weight: torch.Tensor, plan: MLAPlan) -> tuple[MLAWeights, torch.Tensor]:
    """A fitted layer widened to the plan's written head dims with zero rows and columns: per head, q and the
    key half of kv_b get zero no-RoPE dims, the value half of kv_b and o_proj zero value dims, so every score
    and output is unchanged once the softmax scale, (qk_nope + R)^-1/2 in DeepseekV3, is refolded into q."""
    H, n, R, d = plan.num_heads, plan.qk_nope_dim, plan.rope_dim, plan.head_dim
    nope, v = plan.written_dims
    if (nope, v) == (n, d):
        return w, o_weight

    def widened(rows: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
        """Per head, each block of ``width`` rows followed by zero rows up to ``padded``."""
        heads, parts, start = rows.reshape(H, -1, *rows.shape[1:]), [], 0
        for width, padded in blocks:
            parts += [heads[:, start:start + width], heads.new_zeros(H, padded - width, *heads.shape[2:])]
            start += width
        return torch.cat(parts, dim=1).reshape(-1, *rows.shape[1:])

    rescale = math.sqrt((nope + R) / (n + R))
    q_blocks = [(n, nope), (R, R)]
    q_bias = None if w.q_bias is None else widened(w.q_bias, q_blocks) * rescale
    kv_b = widened(w.kv_b_proj, [(n, nope), (d, v)])
    o_proj = widened(o_weight.T, [(d, v)]).T
    return replace(w, q_proj=widened(w.q_proj, q_blocks) * rescale, q_bias=q_bias, kv_b_proj=kv_b), o_proj


@torch.no_grad()
def assemble(source: PreTrainedModel, family: Family, plan: MLAPlan, layers: list[LayerTensors]) -> DeepseekV3ForCausalLM:
    """A DeepseekV3 model with the source's embeddings, norms and MLPs and each layer's converted attention
    (``LayerTensors.replaced``, as the layerwise run made it)."""
    config = deepseek_config(source, plan, source.get_submodule(family.rotary_path).inv_freq)
    model = DeepseekV3ForCausalLM(config).to(source.dtype)
    attention_prefix = f".{family.attention_attr}."
    state = {k: v for k, v in source.state_dict().items() if attention_prefix not in k}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = source.get_output_embeddings().weight
    for layer in layers:
        for path, tensors in layer.replaced.items():
            state.update({f"{path}.{name}": tensor for name, tensor in tensors.items()})
    return load_complete_state(model, state, source.dtype)
