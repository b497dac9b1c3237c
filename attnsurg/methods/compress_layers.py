"""Every compress method in the layerwise run (``methods.layerwise``), streamed or loaded.

Each decoder layer's attention-input and o_proj-input statistics come from the calibration windows' residual
stream carried from the embeddings through the original layers before it, its new tensors are computed in
float64 (``CompressMethod.operate_layer``) and, streamed, written straight to the output shards (``io.shards``)
with the rest of the layer in the output dtype (memory holds one source layer, the stream and at most one
shard of finished tensors), or, loaded, assembled into the model in memory.

Per method: svd, asvd, svdllm factorize each unit at its rank (``--allocate`` needs every layer's spectrum
before the first rank is chosen: a first pass over the layers, ``surveys``, collects them); tucker and cp decompose each projection's head tensor (at a
Tucker ``--ratio`` the mode ranks are chosen per projection on its fitted tensor, so those tensors' shapes are
known only once the layer is done); stacked Tucker fits each layer's q, k, v, o together; Loki adds its key
bases beside the layer's unchanged weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from attnsurg.arch.families import Family
from attnsurg.calibrate import embedded, streamed_layers
from attnsurg.io.lazy import CheckpointReader, rotary_embedding
from attnsurg.io.resume import LayerCheckpoints, StreamStart
from attnsurg.io.shards import planned_tensors
from attnsurg.methods.base import LayerTensors, Operated, method_of
from attnsurg.methods.consumers import LayerContext, layer_inv_freq
from attnsurg.methods.factorized import assemble_factorized, attnsurg_config
from attnsurg.modeling.modeling_attnsurg import CLASSES
from attnsurg.methods.layerwise import LayerwiseTarget, embedded_windows, operate_loaded, write_layerwise

Plan = Any  # a compress method's plan; ``method_of(plan)`` finds the method again


@torch.no_grad()
def compress_streamed(
    reader: CheckpointReader,
    source_config: PretrainedConfig,
    family: Family,
    windows: torch.Tensor,
    plan: Plan,
    output: Path,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
    progress=None,
    device: torch.device | None = None,
    checkpoints: LayerCheckpoints | None = None,
    seed: int = 0,
) -> tuple[PretrainedConfig, list[float]]:
    """Write the compressed model's weights into ``output`` (shards and index; the caller adds config and
    tokenizer); return its config and each unit's relative error (none for Loki, whose plan gets each layer's
    rank). ``checkpoints``: a checkpoint after every layer, and the run resumes from the last one they hold
    (``io.resume``)."""
    method = method_of(plan)
    if refusal := method.plan_stream_refusal(plan):
        raise ValueError(refusal)
    if method.needs_survey(plan):
        method.surveyed(plan, surveys(reader, source_config, family, windows, plan, device))
    config = written_config(source_config, method.planned_surgery(plan, family), dtype)
    planned = planned_tensors(CLASSES[source_config.model_type][1], config, dtype)
    late = factor_names(planned) if method.shapes_known_late(plan) else set()
    operator = CompressOperator(plan, family, source_config, windows.shape[1], seed)
    records = write_layerwise(reader, source_config, family, windows, operator,
                              LayerwiseTarget(output, planned, dtype, max_shard_size, checkpoints, late), progress, device)
    method.warn_capped(plan, operator.unconverged, operator.operated)
    errors = method.apply_records(plan, records)
    return written_config(source_config, method.surgery(plan, family), dtype), errors


class CompressOperator:
    """A compress method's part in the layerwise run: each layer from the statistics of its attention's and
    o_proj's inputs (``CompressMethod.operate_layer``); it carries nothing."""

    received, starts = (), None

    def __init__(self, plan: Plan, family: Family, source_config: PretrainedConfig, seq_len: int, seed: int = 0):
        self.plan, self.method, self.family, self.source_config = plan, method_of(plan), family, source_config
        self.seq_len, self.seed = seq_len, seed
        self.hooked = hooked(family)
        self.rotary = rotary_embedding(source_config)
        self.unconverged: list[tuple[str, float]] = []
        self.operated = 0  # units operated on in this run (a resumed run's earlier ones not counted)

    def begin(self, start: StreamStart) -> None:
        pass

    def operate(self, index: int, layer: torch.nn.Module, statistics: list, inputs: torch.Tensor) -> LayerTensors:
        x, o = statistics
        context = layer_context(layer, x, o, layer_inv_freq(self.rotary, self.source_config, index), self.source_config,
                                self.family, self.seq_len)
        tensors = self.method.operate_layer(self.plan, self.family, index, context, self.seed)
        self.unconverged += tensors.unconverged
        self.operated += len(tensors.records)
        return tensors

    def carried(self) -> dict[str, torch.Tensor]:
        return {}

    def note(self, tensors: LayerTensors) -> str:
        return ""


@torch.no_grad()
def compress_loaded(model: PreTrainedModel, family: Family, windows: torch.Tensor, plan: Plan, progress=None,
                    device: torch.device | None = None, seed: int = 0) -> Operated:
    """The same surgery on a model held in memory (float32 on the CPU), assembled there."""
    method = method_of(plan)
    if method.needs_survey(plan):
        method.surveyed(plan, surveys(None, model.config, family, windows, plan, device, model))
    operator = CompressOperator(plan, family, model.config, windows.shape[1], seed)
    layers = operate_loaded(model, family, windows, operator, progress, device)
    records = [record for layer in layers for record in layer.records]
    method.warn_capped(plan, operator.unconverged, operator.operated)
    errors = method.apply_records(plan, records)
    replaced = {path: state for layer in layers for path, state in layer.replaced.items()}
    added = {name: tensor for layer in layers for name, tensor in layer.added.items()}
    return Operated(assemble_factorized(model, method.surgery(plan, family), replaced, added), plan, errors)


def hooked(family: Family) -> tuple[str, str]:
    """The submodules whose inputs a compress method's statistics are of: the attention and its o_proj."""
    return family.attention_attr, f"{family.attention_attr}.{family.o_proj}"


def layer_context(layer, x, o, inv_freq: torch.Tensor, source_config: PretrainedConfig, family: Family,
                  seq_len: int) -> LayerContext:
    return LayerContext(getattr(layer, family.attention_attr), x.offloaded(), o.offloaded(), inv_freq,
                        source_config.num_attention_heads, source_config.num_key_value_heads, seq_len)


@torch.no_grad()
def surveys(reader: CheckpointReader | None, source_config: PretrainedConfig, family: Family, windows: torch.Tensor,
            plan: Plan, device: torch.device | None = None, model: PreTrainedModel | None = None) -> list:
    """A first pass over every layer, one in memory at a time, for a plan that needs every layer seen before it
    operates on any (``CompressMethod.needs_survey``): each layer's ``survey_layer``. The layers are read from
    ``reader``, or taken from ``model`` in memory."""
    method = method_of(plan)
    rotary = rotary_embedding(source_config)
    if model is None:
        stream, layers = embedded(reader, source_config, family, windows), None
    else:
        stream, layers = embedded_windows(model, windows), model.get_submodule(family.layers_path)
    return [method.survey_layer(plan, index, layer_context(layer, x, o, layer_inv_freq(rotary, source_config, index),
                                                           source_config, family, windows.shape[1]))
            for index, layer, (x, o), _ in streamed_layers(reader, source_config, family, stream, hooked(family), device,
                                                          layers=layers)]


def written_config(source_config: PretrainedConfig, surgery: dict, dtype: torch.dtype) -> PretrainedConfig:
    """The output's config: the source's family under attnsurg's model type, with ``surgery`` and ``dtype``."""
    config = attnsurg_config(source_config, surgery)
    config.dtype = str(dtype).removeprefix("torch.")
    return config


def factor_names(planned: dict[str, torch.Tensor]) -> set[str]:
    """The head-tensor factors and cores, whose shapes a Tucker --ratio chooses per projection."""
    return {name for name in planned if name.rsplit(".", 1)[-1] in ("factor_heads", "factor_dim", "factor_hidden", "core")}
