"""Converting a model held in memory: the layerwise run (``methods.layerwise``) of ``MLAOperator`` over its
layers, assembled into a DeepseekV3 model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DeepseekV3ForCausalLM, PreTrainedModel

from attnsurg.arch.families import Family
from attnsurg.calibrate import input_statistics
from attnsurg.methods.mla.assemble import assemble
from attnsurg.methods.mla.operator import MLAOperator
from attnsurg.methods.mla.plan import MLAPlan
from attnsurg.methods.mla.refine import LayerError, Refinement
from attnsurg.methods.mla.split import SPLIT_HELD_OUT, SplitChoice, choose_split
from attnsurg.methods.layerwise import operate_loaded


@dataclass
class MLAConversion:
    """A converted model, its plan and each refined layer's output error (before, after refinement)."""

    model: DeepseekV3ForCausalLM
    plan: MLAPlan
    layer_errors: list[LayerError]
    split: SplitChoice | None = None  # the candidate splits compared, when the plan was chosen on data


@torch.no_grad()
def convert(
    source: PreTrainedModel,
    family: Family,
    windows: torch.Tensor,
    plan: MLAPlan,
    weighted: bool = True,
    refinement: Refinement | None = None,
    progress=None,
    starts: torch.Tensor | None = None,
    device: torch.device | None = None,
    received: bool = False,
    candidates: list[MLAPlan] | None = None,
) -> MLAConversion:
    """Convert every layer from calibration windows (token ids): the closed form from the attention inputs'
    second moment over all windows, then, given ``refinement`` with steps, sequential refinement on the first
    ``refinement.tokens`` of them, watched on up to HELD_OUT_SHARE as many windows that follow them.
    ``starts`` ([n, L] bool, ``calibrate.short_prompt_starts``) cuts the windows into prompts of their own.
    ``device``: where the calibration pass and refinement run (the fitting runs in float64 on the CPU).
    ``received``: fit what the cache carries on tokens weighted by the attention they receive (``fit_layer``).
    ``candidates``: plans of other splits of the same budget, the one with the lowest closed-form error on the
    last windows kept instead of ``plan`` (``split.choose_split``)."""
    split = None
    if candidates and len(candidates) > 1:
        attentions = [getattr(layer, family.attention_attr) for layer in source.get_submodule(family.layers_path)]
        split = measured_split(source, family, attentions, windows, starts, device,
                               attentions if received else (), candidates, weighted)
        plan = split.chosen
    operator = MLAOperator(plan, family, source.config, windows.shape[1], weighted, refinement, source.dtype, device,
                           received, starts)
    layers = operate_loaded(source, family, windows, operator, progress, device)
    errors = [record for layer in layers for record in layer.records]
    return MLAConversion(assemble(source, family, plan, layers), plan, errors, split)


def measured_split(source: PreTrainedModel, family: Family, attentions: list, windows: torch.Tensor,
                   starts: torch.Tensor | None, device, weighed, candidates: list[MLAPlan],
                   weighted: bool) -> SplitChoice:
    """The candidate split with the lowest closed-form error on the last SPLIT_HELD_OUT windows, fitted on the
    others."""
    fit, held = windows[:-SPLIT_HELD_OUT], windows[-SPLIT_HELD_OUT:]
    cut = None if starts is None else starts[:-SPLIT_HELD_OUT]
    fit_statistics = input_statistics(source, attentions, fit, cut, device, received=weighed)
    return choose_split(source, attentions, fit_statistics, held, candidates, weighted,
                        source.get_submodule(family.rotary_path))
