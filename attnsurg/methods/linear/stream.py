"""Conversion to hybrid linear attention one decoder layer at a time (``pipelines.layerwise``): each source
layer's feature maps fitted on the residual stream carried through the source layers before it, and written
with the layer's unchanged tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from attnsurg.arch.families import Family
from attnsurg.io.lazy import CheckpointReader, rotary_embedding
from attnsurg.io.resume import LayerCheckpoints, StreamStart
from attnsurg.io.shards import planned_tensors
from attnsurg.methods.base import LayerTensors
from attnsurg.methods.compress_stream import written_config
from attnsurg.methods.linear.transfer import LayerTransfer, Transfer, TransferError
from attnsurg.modeling.modeling_attnsurg import CLASSES
from attnsurg.pipelines.layerwise import LayerwiseTarget, write_layerwise


@torch.no_grad()
def linear_streamed(
    reader: CheckpointReader, source_config: PretrainedConfig, family: Family, windows: torch.Tensor, plan,
    transfer: Transfer, held_out: int, output: Path, dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB", progress=None, device: torch.device | None = None,
    checkpoints: LayerCheckpoints | None = None, seed: int = 0,
) -> tuple[PretrainedConfig, list[TransferError]]:
    """Write the converted model's weights into ``output`` (shards and index; the caller adds config and
    tokenizer); return its config and each layer's transfer errors. ``checkpoints``: one after every layer,
    and the run resumes from the last one they hold (``io.resume``)."""
    config = written_config(source_config, plan.surgery(), dtype)
    operator = LinearOperator(plan, family, source_config, transfer, held_out, dtype, device or torch.device("cpu"), seed)
    target = LayerwiseTarget(output, planned_tensors(CLASSES[source_config.model_type][1], config, dtype), dtype,
                             max_shard_size, checkpoints)
    records = write_layerwise(reader, source_config, family, windows, operator, target, progress, device)
    return config, [TransferError(*record) for record in records]


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
        fitter = LayerTransfer(self.family, self.rotary, inputs.to(self.device))
        layer = layer.to(self.device)
        x, target = fitter.layer_io(layer)
        features, error = fitter.fitted(layer, x, target, self.source_config, index, self.plan.shape, self.transfer,
                                        self.held_out, self.seed)
        layer.to("cpu")
        prefix = f"{self.family.layers_path}.{index}.{self.family.attention_attr}."
        return LayerTensors(added={prefix + name: tensor.cpu().to(self.dtype) for name, tensor in features.items()},
                            records=[error])

    def carried(self) -> dict[str, torch.Tensor]:
        return {}

    def note(self, tensors: LayerTensors) -> str:
        return f"layer error {tensors.records[-1].before:.3f} -> {tensors.records[-1].after:.3f}"
