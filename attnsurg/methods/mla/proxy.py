"""MLA for ``analyze plan``: each layer's closed-form relative output error on calibration windows (the
conversion before refinement), at every candidate KV budget."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.calibrate import captured_inputs, causal_mask
from attnsurg.methods.mla.assemble import deepseek_config
from attnsurg.methods.mla.fit import fit_layer
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.methods.mla.refine import mla_attention, sampled_output
from attnsurg.methods.planning import PROXY_WINDOWS, PlanContext, PlannedMethod, register_planned
from attnsurg.recipe import MLASettings

KV_BUDGETS = (0.1875, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75)


@torch.no_grad()
def mla_proxy(ctx: PlanContext, budgets: tuple[float, ...]) -> list[list[float]]:
    attentions = ctx.attentions()
    inputs = captured_inputs(ctx.model, attentions, ctx.windows[:PROXY_WINDOWS])
    rotary = ctx.model.get_submodule(ctx.family.rotary_path)
    length = ctx.windows.shape[1]
    positions = torch.arange(length)[None]
    targets = [attention(hidden_states=x, position_embeddings=rotary(x, positions), attention_mask=causal_mask(length))[0]
               for attention, x in zip(attentions, inputs, strict=True)]
    inv_freq = rotary.inv_freq
    errors = []
    for budget in budgets:
        plan = plan_mla(ctx.anatomy, kv_budget=budget)
        config = deepseek_config(ctx.model, plan.fitted, inv_freq)
        config._attn_implementation = "sdpa"
        rope = DeepseekV3RotaryEmbedding(config)(inputs[0][:1], positions)
        row = []
        for index, (attention, x, target) in enumerate(zip(attentions, inputs, targets, strict=True)):
            stats = ctx.stats[index][0]
            converted = mla_attention(config, index, fit_layer(attention, stats.sigma, plan, True, stats.sigma_first, inv_freq,
                                                                stats.sigma_received),
                                      attention.o_proj.weight)
            output = sampled_output(converted, x, rope, torch.arange(length))
            # the first token (an attention sink with an outsized output) is left out of both sums
            row.append(float((output - target)[:, 1:].pow(2).sum() / target[:, 1:].pow(2).sum()))
        errors.append(row)
    return errors


def mla_settings(budget: float, anatomy: AttentionAnatomy) -> MLASettings:
    return MLASettings(kv_budget=budget)


register_planned(PlannedMethod("mla", KV_BUDGETS, (0.25, 0.5), mla_settings, mla_proxy))
