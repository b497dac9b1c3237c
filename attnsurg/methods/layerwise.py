"""The surgery's layer loop, one for every method, in two runs. Streamed (``write_layerwise``): each decoder
layer read alone from the checkpoint (``io.lazy``), observed on the calibration windows' residual stream carried
from the embeddings through the source layers before it, operated on by the method, and written straight into
the output shards (``io.shards``) before the next layer is read; memory holds one source layer, the stream (and
whatever the method carries) and at most one shard of finished tensors. Loaded (``operate_loaded``): the same
loop over a model in memory, each layer's tensors returned for the method to assemble.

A method takes part through a ``LayerOperator``: what it observes of each layer, what it makes of one layer,
and what it carries from layer to layer (saved with every checkpoint, so a run resumes after any layer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import PretrainedConfig, PreTrainedModel

from attnsurg.arch.families import Family
from attnsurg.calibrate import InputStatistics, streamed_layers
from attnsurg.io.lazy import CheckpointReader, embedding_scale
from attnsurg.io.resume import LayerCheckpoints, StreamStart, start_stream
from attnsurg.io.shards import ShardWriter
from attnsurg.methods.base import LayerTensors


class LayerOperator(Protocol):
    """One method's work in a layerwise run."""

    hooked: tuple[str, ...]  # submodules (of a decoder layer) whose input statistics ``operate`` receives
    received: tuple[str, ...]  # those among them whose tokens are weighed by the attention they receive
    starts: torch.Tensor | None  # [n, L] bool: the windows cut into prompts of their own (``short_prompt_starts``)

    def begin(self, start: StreamStart) -> None:
        """Take up the run where ``start`` says: the stream entering its first layer and what was carried."""

    def operate(self, index: int, layer: torch.nn.Module, statistics: list[InputStatistics],
                inputs: torch.Tensor) -> LayerTensors:
        """Layer ``index``'s new tensors from its statistics and ``inputs``, the stream entering it."""

    def carried(self) -> dict[str, torch.Tensor]:
        """What the method carries to the next layer (besides the source's stream), to resume from."""

    def note(self, tensors: LayerTensors) -> str:
        """The progress bar's note after a layer."""


@dataclass
class LayerwiseTarget:
    """Where and how a layerwise run writes: the shards' directory, the tensors it will hold (name -> meta
    tensor; ``flexible``: those whose shapes are known only once their layer is done), their dtype and the
    run's checkpoints."""

    directory: Path
    planned: dict[str, torch.Tensor]
    dtype: torch.dtype = torch.float32
    max_shard_size: int | str = "5GB"
    checkpoints: LayerCheckpoints | None = None
    flexible: set[str] = field(default_factory=set)


@torch.no_grad()
def write_layerwise(reader: CheckpointReader, config: PretrainedConfig, family: Family, windows: torch.Tensor,
                    operator: LayerOperator, target: LayerwiseTarget, progress: Callable | None = None,
                    device: torch.device | None = None) -> list:
    """Write every tensor of the converted model into ``target.directory`` (shards and index; the caller adds
    config and tokenizer), the decoder layers as ``operator`` makes them; return every layer's records, in
    order (those of a resumed run's earlier layers first)."""
    top = family.layers_path.rsplit(".", 1)[0]
    with ShardWriter(target.directory, target.planned, target.max_shard_size, flexible=target.flexible) as writer:
        start = start_stream(reader, top, windows, writer, target.dtype, config.tie_word_embeddings,
                             target.checkpoints, config.num_hidden_layers, embedding_scale(config))
        if progress and start.layer:
            progress(start.layer)
        operator.begin(start)
        records, inputs = list(start.errors), start.stream
        for index, layer, statistics, stream in streamed_layers(reader, config, family, start.stream, operator.hooked,
                                                                device, start.layer, received=operator.received,
                                                                starts=operator.starts):
            tensors = operator.operate(index, layer, statistics, inputs)
            write_layer(writer, f"{family.layers_path}.{index}.", layer, tensors)
            records += tensors.records
            inputs = stream
            if target.checkpoints:
                target.checkpoints.save(index + 1, {"stream": stream, **operator.carried()}, writer, records)
            if progress:
                progress(note=operator.note(tensors))
        writer.finish()
    return records


@torch.no_grad()
def operate_loaded(model: PreTrainedModel, family: Family, windows: torch.Tensor, operator: LayerOperator,
                   progress: Callable | None = None, device: torch.device | None = None) -> list[LayerTensors]:
    """The layerwise run over ``model`` in memory (float32 on the CPU; ``device``: where each layer's pass and the
    stream run): ``write_layerwise``'s loop with each layer taken from the model; returns every layer's tensors."""
    stream = embedded_windows(model, windows)
    operator.begin(StreamStart(0, stream, {}, []))
    layers, inputs = [], stream
    for index, layer, statistics, advanced in streamed_layers(None, model.config, family, stream, operator.hooked, device,
                                                              received=operator.received, starts=operator.starts,
                                                              layers=model.get_submodule(family.layers_path)):
        layers.append(operator.operate(index, layer, statistics, inputs))
        inputs = advanced
        if progress:
            progress(note=operator.note(layers[-1]))
    return layers


def embedded_windows(model: PreTrainedModel, windows: torch.Tensor) -> torch.Tensor:
    """The first decoder layer's input on every window, float32 on the CPU (the family's embedding scale
    included: the model's embedding module applies it)."""
    return model.get_input_embeddings()(windows.to(model.device)).float().cpu()


def write_layer(writer: ShardWriter, prefix: str, layer: torch.nn.Module, tensors: LayerTensors) -> None:
    """One decoder layer: the replaced modules' tensors, the added ones, and every other tensor of the source
    layer as it is."""
    for path, state in tensors.replaced.items():
        for name, tensor in state.items():
            writer.add(f"{path}.{name}", tensor)
    for name, tensor in tensors.added.items():
        writer.add(name, tensor)
    for name, tensor in layer.state_dict().items():
        if not any((prefix + name).startswith(path + ".") for path in tensors.replaced):
            writer.add(prefix + name, tensor)
