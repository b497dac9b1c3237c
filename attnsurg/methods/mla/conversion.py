"""Converting a model held in memory: statistics, closed forms and refinement, layer by layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import DeepseekV3ForCausalLM, PreTrainedModel

from attnsurg.arch.families import Family
from attnsurg.calibrate import input_statistics
from attnsurg.methods.mla.assemble import assemble, deepseek_config
from attnsurg.methods.mla.fit import layer_closed_forms
from attnsurg.methods.mla.plan import MLAPlan
from attnsurg.methods.mla.refine import HELD_OUT_SHARE, LayerError, Refinement, SequentialRefiner
from attnsurg.methods.mla.split import SPLIT_HELD_OUT, SplitChoice, choose_split, merged


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
    # One hooked pass streams each attention input's second moment over all windows; refinement starts from the
    # token embeddings of its windows (the first decoder layer's input in the Llama family).
    attentions = [getattr(layer, family.attention_attr) for layer in source.get_submodule(family.layers_path)]
    weighed = attentions if received else ()
    split = None
    if candidates and len(candidates) > 1:
        split, statistics = measured_split(source, family, attentions, windows, starts, device, weighed, candidates,
                                           weighted)
        plan = split.chosen
    else:
        statistics = input_statistics(source, attentions, windows, starts, device, received=weighed)
    refinement = refinement if refinement and refinement.steps else None
    inv_freq = source.get_submodule(family.rotary_path).inv_freq
    config = deepseek_config(source, plan.fitted, inv_freq)
    config._attn_implementation = "sdpa"  # the standalone refinement modules (sampled_output calls sdpa itself)
    refiner = None
    if refinement:
        keep = min(len(windows), max(1, refinement.tokens // windows.shape[1]))
        held_out = min(len(windows) - keep, math.ceil(keep * HELD_OUT_SHARE))
        embeddings = source.get_input_embeddings()(windows[: keep + held_out].to(source.device)).float().cpu()
        used = None if starts is None else starts[: keep + held_out]
        refiner = SequentialRefiner(source.get_submodule(family.rotary_path), family, embeddings, config, held_out, used,
                                    device)
    layers, errors = [], []
    for index, (attn, stats) in enumerate(zip(attentions, statistics)):
        weights, *alternatives = layer_closed_forms(attn, stats, plan, weighted, inv_freq)
        if refiner:
            weights, error = refiner.refine(index, source.get_submodule(f"{family.layers_path}.{index}"), weights, refinement,
                                            alternatives)
            errors.append(error)
        layers.append(weights)
        if progress:
            progress(note=f"layer error {errors[-1].before:.3f} -> {errors[-1].after:.3f}" if errors else "")
    return MLAConversion(assemble(source, family, plan, layers), plan, errors, split)


def measured_split(source: PreTrainedModel, family: Family, attentions: list, windows: torch.Tensor,
                   starts: torch.Tensor | None, device, weighed, candidates: list[MLAPlan],
                   weighted: bool) -> tuple[SplitChoice, list]:
    """The candidate split with the lowest closed-form error on the last SPLIT_HELD_OUT windows, fitted on the
    others, and the statistics of all windows (the two passes merged: one pass's cost)."""
    fit, held = windows[:-SPLIT_HELD_OUT], windows[-SPLIT_HELD_OUT:]
    cut = (None, None) if starts is None else (starts[:-SPLIT_HELD_OUT], starts[-SPLIT_HELD_OUT:])
    fit_statistics = input_statistics(source, attentions, fit, cut[0], device, received=weighed)
    held_statistics = input_statistics(source, attentions, held, cut[1], device, received=weighed)
    choice = choose_split(source, attentions, fit_statistics, held, candidates, weighted,
                          source.get_submodule(family.rotary_path))
    return choice, [merged(a, b) for a, b in zip(fit_statistics, held_statistics, strict=True)]
