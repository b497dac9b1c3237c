"""Hybrid linear attention for ``analyze plan``: each layer's attention-transfer error on a held-out
calibration window after a short fit, at every candidate window."""

from __future__ import annotations

import torch

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.methods.linear.method import LinearSettings, plan_linear
from attnsurg.methods.linear.transfer import LayerTransfer, Transfer
from attnsurg.methods.planning import PROXY_WINDOWS, PlanContext, PlannedMethod, register_planned

WINDOWS = (16, 32, 64, 128, 256)
PROXY_TRANSFER = Transfer(steps=40)  # a short fit: the proxy ranks windows, the anchors are converted in full


@torch.no_grad()
def linear_proxy(ctx: PlanContext, budgets: tuple[float, ...]) -> list[list[float]]:
    """[window][layer]: the held-out relative output error after PROXY_TRANSFER on the other windows (zero
    where the window covers the calibration window)."""
    windows = ctx.windows[: PROXY_WINDOWS + 1]  # the last held out
    stream = ctx.model.get_input_embeddings()(windows.to(ctx.model.device)).float()
    fitter = LayerTransfer(ctx.family, ctx.model.get_submodule(ctx.family.rotary_path), stream)
    errors: list[list[float]] = [[] for _ in budgets]
    for index, layer in enumerate(ctx.model.get_submodule(ctx.family.layers_path)):
        x, target = fitter.layer_io(layer)
        for row, window in zip(errors, budgets, strict=True):
            if window >= windows.shape[1]:
                row.append(0.0)
                continue
            shape = plan_linear(ctx.anatomy, linear_settings(window, ctx.anatomy)).shape
            _, error = fitter.fitted(layer, x, target, ctx.model.config, index, shape, PROXY_TRANSFER, held_out=1)
            row.append(error.held_after)
        fitter.advance(layer, target)
    return errors


def linear_settings(budget: float, anatomy: AttentionAnatomy) -> LinearSettings:
    return LinearSettings(window=int(budget))


register_planned(PlannedMethod("linear", WINDOWS, (32, 128), linear_settings, linear_proxy))
