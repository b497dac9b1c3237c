"""MLA for ``analyze plan``: each layer's closed-form relative output error on calibration windows (the
conversion before refinement), at every candidate KV budget."""

from __future__ import annotations

import torch

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.calibrate import captured_inputs
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.methods.mla.split import closed_form_errors, original_outputs
from attnsurg.methods.planning import PROXY_WINDOWS, PlanContext, PlannedMethod, register_planned
from attnsurg.methods.mla.settings import MLASettings

KV_BUDGETS = (0.1875, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75)


@torch.no_grad()
def mla_proxy(ctx: PlanContext, budgets: tuple[float, ...]) -> list[list[float]]:
    attentions = ctx.attentions()
    inputs = captured_inputs(ctx.model, attentions, ctx.windows[:PROXY_WINDOWS])
    rotary = ctx.model.get_submodule(ctx.family.rotary_path)
    targets = original_outputs(attentions, inputs, rotary)
    statistics = [layer[0] for layer in ctx.stats]
    return [closed_form_errors(ctx.model, attentions, statistics, inputs, targets, plan_mla(ctx.anatomy, kv_budget=budget),
                               True, rotary) for budget in budgets]


def mla_settings(budget: float, anatomy: AttentionAnatomy) -> MLASettings:
    return MLASettings(kv_budget=budget)


register_planned(PlannedMethod("mla", KV_BUDGETS, (0.25, 0.5), mla_settings, mla_proxy))
