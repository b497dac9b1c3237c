"""Conversion to hybrid linear attention one decoder layer at a time: each source layer read alone from the
checkpoint (``io.lazy``), fitted on the residual stream carried through the layers before it, and written
straight into the output shards (``io.shards``) with its feature maps. Memory holds one source layer, the
stream and at most one shard of finished tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from attnsurg.arch.families import Family
from attnsurg.io.lazy import CheckpointReader, load_layer, rotary_embedding
from attnsurg.io.resume import LayerCheckpoints, start_stream
from attnsurg.io.shards import ShardWriter, planned_tensors
from attnsurg.methods.compress_stream import written_config
from attnsurg.methods.linear.transfer import LayerTransfer, Transfer, TransferError
from attnsurg.modeling.modeling_attnsurg import CLASSES


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
    device = device or torch.device("cpu")
    config = written_config(source_config, plan.surgery(), dtype)
    planned = planned_tensors(CLASSES[source_config.model_type][1], config, dtype)
    top = family.layers_path.rsplit(".", 1)[0]
    with ShardWriter(output, planned, max_shard_size) as writer:
        start = start_stream(reader, top, windows, writer, dtype, config.tie_word_embeddings, checkpoints,
                             config.num_hidden_layers)
        if progress and start.layer:
            progress(start.layer)
        fitter = LayerTransfer(family, rotary_embedding(source_config).to(device), start.stream.to(device))
        errors = [TransferError(*error) for error in start.errors]
        for index in range(start.layer, config.num_hidden_layers):
            layer = load_layer(reader, source_config, index, prefix=family.layers_path).to(device)
            features, error = fitter.fit(layer, source_config, index, plan.shape, transfer, held_out, seed)
            prefix = f"{family.layers_path}.{index}."
            for name, tensor in layer.state_dict().items():
                writer.add(prefix + name, tensor.to(dtype))
            for name, tensor in features.items():
                writer.add(f"{prefix}{family.attention_attr}.{name}", tensor.cpu().to(dtype))
            errors.append(error)
            if checkpoints:
                checkpoints.save(index + 1, {"stream": fitter.stream.cpu()}, writer, errors)
            if progress:
                progress(note=f"layer error {error.before:.3f} -> {error.after:.3f}")
        writer.finish()
    return config, errors
