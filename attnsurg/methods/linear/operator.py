"""The hybrid's part in the layerwise run (``methods.layerwise``), loaded or streamed."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from attnsurg.arch.families import Family
from attnsurg.io.lazy import rotary_embedding
from attnsurg.io.resume import StreamStart
from attnsurg.methods.base import LayerTensors
from attnsurg.methods.linear.transfer import LayerTransfer, Transfer
from attnsurg.placement import on_device


class LinearOperator:
    """The hybrid's part in the layerwise run: each layer's feature maps trained to reproduce its softmax
    attention on the stream entering it (``LayerTransfer``); it carries nothing but the source's stream."""

    hooked, received, starts = (), (), None

    def __init__(self, plan, family: Family, source_config: PretrainedConfig, transfer: Transfer, held_out: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0):
        self.plan, self.family, self.source_config, self.transfer = plan, family, source_config, transfer
        self.held_out, self.dtype, self.device, self.seed = held_out, dtype, device, seed
        self.rotary = rotary_embedding(source_config).to(device)

    def begin(self, start: StreamStart) -> None:
        pass

    def operate(self, index: int, layer: torch.nn.Module, statistics: list, inputs: torch.Tensor) -> LayerTensors:
        if index in self.plan.full_layers:
            return LayerTensors()  # the source's attention, unchanged
        fitter = LayerTransfer(self.family, self.rotary, inputs.to(self.device))
        with on_device(layer, self.device):
            x, target = fitter.layer_io(layer)
            features, error = fitter.fitted(layer, x, target, self.source_config, index, self.plan.shape, self.transfer,
                                            self.held_out, self.seed)
        prefix = f"{self.family.layers_path}.{index}.{self.family.attention_attr}."
        return LayerTensors(added={prefix + name: tensor.cpu().to(self.dtype) for name, tensor in features.items()},
                            records=[error])

    def carried(self) -> dict[str, torch.Tensor]:
        return {}

    def note(self, tensors: LayerTensors) -> str:
        if not tensors.records:
            return "softmax attention kept"
        return f"layer error {tensors.records[-1].before:.3f} -> {tensors.records[-1].after:.3f}"
