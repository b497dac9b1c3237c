"""Conversion to hybrid linear attention one decoder layer at a time (``methods.layerwise``): each source
layer's feature maps fitted on the residual stream carried through the source layers before it, and written
with the layer's unchanged tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from attnsurg.arch.families import Family
from attnsurg.io.lazy import CheckpointReader
from attnsurg.io.resume import LayerCheckpoints
from attnsurg.io.shards import planned_tensors
from attnsurg.methods.compress_layers import written_config
from attnsurg.methods.linear.operator import LinearOperator
from attnsurg.methods.linear.transfer import Transfer, TransferError
from attnsurg.modeling.modeling_attnsurg import CLASSES
from attnsurg.methods.layerwise import LayerwiseTarget, write_layerwise


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
