"""MLA's part in the layerwise run (``methods.layerwise``), loaded or streamed: each layer's closed forms from
its attention input's statistics, then sequential refinement, which carries the original and the converted
residual streams of its windows from layer to layer."""

from __future__ import annotations

import math

import torch
from transformers import PretrainedConfig

from attnsurg.arch.families import Family
from attnsurg.io.lazy import rotary_embedding
from attnsurg.io.resume import StreamStart
from attnsurg.methods.base import LayerTensors
from attnsurg.methods.mla.assemble import attention_state, deepseek_config, padded_heads
from attnsurg.methods.mla.fit import layer_closed_forms
from attnsurg.methods.mla.plan import MLAPlan
from attnsurg.methods.mla.refine import HELD_OUT_SHARE, Refinement, SequentialRefiner


class MLAOperator:
    """MLA's part in the layerwise run: each layer's closed forms from its attention input's statistics, then
    sequential refinement, which carries the original and the converted residual streams of its windows."""

    def __init__(self, plan: MLAPlan, family: Family, source_config: PretrainedConfig, window: int, weighted: bool,
                 refinement: Refinement | None, dtype: torch.dtype, device: torch.device | None, received: bool,
                 starts: torch.Tensor | None):
        self.plan, self.family, self.window, self.weighted, self.dtype, self.device = plan, family, window, weighted, dtype, device
        self.refinement = refinement if refinement and refinement.steps else None
        self.rotary = rotary_embedding(source_config)
        self.fitted = deepseek_config(source_config, plan.fitted, self.rotary.inv_freq)
        self.fitted._attn_implementation = "sdpa"
        self.hooked = (family.attention_attr,)
        self.received = self.hooked if received else ()
        self.starts = starts
        self.refiner: SequentialRefiner | None = None

    def begin(self, start: StreamStart) -> None:
        self.refiner = started_refiner(self.rotary, self.family, self.fitted, start, self.window, self.refinement,
                                       self.device, self.starts)

    def operate(self, index: int, layer: torch.nn.Module, statistics: list, inputs: torch.Tensor) -> LayerTensors:
        attention = getattr(layer, self.family.attention_attr)
        weights, *alternatives = layer_closed_forms(attention, statistics[0], self.plan, self.weighted, self.rotary.inv_freq)
        records = []
        if self.refiner:
            weights, error = self.refiner.refine(index, layer, weights, self.refinement, alternatives)
            records.append(error)
        w, o_weight = padded_heads(weights, attention.o_proj.weight.double(), self.plan)
        state = {name: tensor.to(self.dtype) for name, tensor in attention_state(w, o_weight, self.plan.query_route).items()}
        return LayerTensors(replaced={f"{self.family.layers_path}.{index}.{self.family.attention_attr}": state},
                            records=records)

    def carried(self) -> dict[str, torch.Tensor]:
        return self.refiner.carried() if self.refiner else {}

    def note(self, tensors: LayerTensors) -> str:
        return f"layer error {tensors.records[-1].before:.3f} -> {tensors.records[-1].after:.3f}" if tensors.records else ""


def started_refiner(rotary, family: Family, fitted: PretrainedConfig, start: StreamStart, window: int,
                    refinement: Refinement | None, device: torch.device | None,
                    starts: torch.Tensor | None = None) -> SequentialRefiner | None:
    """The refiner for a run starting at ``start``: its windows are the first of the stream (those it trains on,
    then its held-out ones), and a resumed run carries on with the streams it had."""
    if not refinement:
        return None
    count = len(start.stream)
    keep = min(count, max(1, refinement.tokens // window))
    held_out = min(count - keep, math.ceil(keep * HELD_OUT_SHARE))
    used = None if starts is None else starts[: keep + held_out]
    refiner = SequentialRefiner(rotary, family, start.stream[: keep + held_out].clone(), fitted, held_out, used, device)
    if start.carried:
        refiner.resume(start.carried)
    return refiner
