"""Every compress method one decoder layer at a time, for models larger than memory.

The same surgery as the loaded ``compress``: each decoder layer is read from the checkpoint in float32
(``io.lazy``), its attention-input and o_proj-input statistics come from the calibration windows' residual
stream carried from the embeddings through the original layers before it (what one hooked pass of the loaded
model gives), and its new tensors are computed in float64 and written straight to the output shards
(``io.shards``) with the rest of the layer in the output dtype. Memory holds one source layer, the stream and
at most one shard of finished tensors.

Per method: svd, asvd, svdllm factorize with uniform ranks (``--allocate`` needs every layer's spectrum before
the first rank is chosen, so it does not stream); tucker and cp decompose each projection's head tensor (at a
Tucker ``--ratio`` the mode ranks are chosen per projection on its fitted tensor, so those tensors' shapes are
known only once the layer is done); stacked Tucker fits each layer's q, k, v, o together; Loki adds its key
bases beside the layer's unchanged weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PretrainedConfig

from attnsurg.arch.families import Family
from attnsurg.calibrate import streamed_layers
from attnsurg.io.lazy import CheckpointReader, rotary_embedding
from attnsurg.io.resume import LayerCheckpoints, start_stream
from attnsurg.io.shards import ShardWriter, planned_tensors
from attnsurg.methods import headtensor, stacked_tucker
from attnsurg.methods.factorized import attnsurg_config
from attnsurg.methods.headtensor import HeadTensorPlan
from attnsurg.methods.loki import LokiPlan, layer_basis, planned_surgery
from attnsurg.methods.lowrank import LayerContext, LowRankPlan, decompose, unit_state
from attnsurg.methods.stacked_tucker import StackedTuckerPlan
from attnsurg.modeling.modeling_attnsurg import CLASSES

Plan = LowRankPlan | HeadTensorPlan | StackedTuckerPlan | LokiPlan


@dataclass
class LayerTensors:
    """What one layer's surgery writes: replaced modules (module path -> its tensors), added tensors (full
    names), its records for the report and a resume, and fits stopped at their iteration cap."""

    replaced: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    added: dict[str, torch.Tensor] = field(default_factory=dict)
    records: list = field(default_factory=list)
    unconverged: list[tuple[str, float]] = field(default_factory=list)


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
    if isinstance(plan, LowRankPlan) and plan.allocate:
        raise ValueError("allocated ranks need every layer's spectrum first; stream with uniform ranks")
    planning = planned_surgery(plan) if isinstance(plan, LokiPlan) else surgery_of(plan, family)
    config = written_config(source_config, planning, dtype)
    planned = planned_tensors(CLASSES[source_config.model_type][1], config, dtype)
    chosen = isinstance(plan, HeadTensorPlan) and plan.choose_ranks  # shapes known once each layer is done
    with ShardWriter(output, planned, max_shard_size, flexible=factor_names(planned) if chosen else ()) as writer:
        start = start_stream(reader, family.layers_path.rsplit(".", 1)[0], windows, writer, dtype, config.tie_word_embeddings,
                             checkpoints, config.num_hidden_layers)
        if progress and start.layer:
            progress(start.layer)
        inv_freq = rotary_embedding(source_config).inv_freq
        records, unconverged = list(start.errors), []
        hooked = (family.attention_attr, f"{family.attention_attr}.{family.o_proj}")
        for index, layer, (x, o), stream in streamed_layers(reader, source_config, family, start.stream, hooked, device,
                                                            start.layer):
            context = LayerContext(getattr(layer, family.attention_attr), x.offloaded(), o.offloaded(), inv_freq,
                                   source_config.num_attention_heads, source_config.num_key_value_heads, windows.shape[1])
            tensors = operate_layer(plan, family, index, context, seed)
            records += tensors.records
            unconverged += tensors.unconverged
            write_layer(writer, f"{family.layers_path}.{index}.", layer, tensors)
            if checkpoints:
                checkpoints.save(index + 1, {"stream": stream}, writer, records)
            if progress:
                progress()
        writer.finish()
    warn_capped(plan, unconverged, len(records) - len(start.errors))
    errors = apply_records(plan, records)
    return written_config(source_config, surgery_of(plan, family), dtype), errors


def surgery_of(plan: Plan, family: Family) -> dict:
    return plan.surgery() if isinstance(plan, LokiPlan) else plan.surgery(family)


def written_config(source_config: PretrainedConfig, surgery: dict, dtype: torch.dtype) -> PretrainedConfig:
    """The output's config: the source's family under attnsurg's model type, with ``surgery`` and ``dtype``."""
    config = attnsurg_config(source_config, surgery)
    config.dtype = str(dtype).removeprefix("torch.")
    return config


def factor_names(planned: dict[str, torch.Tensor]) -> set[str]:
    """The head-tensor factors and cores, whose shapes a Tucker --ratio chooses per projection."""
    return {name for name in planned if name.rsplit(".", 1)[-1] in ("factor_heads", "factor_dim", "factor_hidden", "core")}


def operate_layer(plan: Plan, family: Family, index: int, context: LayerContext, seed: int) -> LayerTensors:
    """One decoder layer's surgery from its statistics (``context``), as the loaded ``compress`` does it."""
    attention = f"{family.layers_path}.{index}.{family.attention_attr}"
    if isinstance(plan, LokiPlan):
        basis, rank = layer_basis(context.attn, context.x, plan, context.inv_freq, context.seq_len)
        return LayerTensors(added={f"{attention}.loki_basis": basis}, records=[rank])
    if isinstance(plan, HeadTensorPlan):
        fit = headtensor.decompose_layer(plan, index, context.attn, context, seed)
        ranks = [list(plan.ranks[i]) if plan.ranks[i] else None for i, u in enumerate(plan.units) if u.layer == index]
        return LayerTensors({f"{attention}.{name}": state for name, state in fit.replaced.items()}, {},
                            [[error, r] for error, r in zip(fit.errors, ranks, strict=True)], fit.unconverged)
    if isinstance(plan, StackedTuckerPlan):
        return stacked_layer(plan, attention, index, context, seed)
    tensors = LayerTensors()
    for unit, rank in zip(plan.units, plan.ranks, strict=True):
        if unit.layer != index:
            continue
        if rank is None:  # kept dense
            tensors.records.append(0.0)
            continue
        decomposition = decompose(unit, context, plan.method, plan.weighted)
        tensors.replaced.update(unit_state(unit, family, *decomposition.factors(rank), decomposition.bias))
        tensors.records.append(decomposition.relative_error(rank))
    return tensors


def stacked_layer(plan: StackedTuckerPlan, attention: str, index: int, context: LayerContext, seed: int) -> LayerTensors:
    """One layer's q, k, v, o fitted together (``stacked_tucker``); it replaces the whole attention."""
    tensors = LayerTensors()
    for unit, ranks in zip(plan.units, plan.ranks, strict=True):
        if unit.layer == index:
            stacked = stacked_tucker.stack_layer(unit, context.attn, context.x, context.o, context if plan.weighted else None)
            fit = stacked_tucker.fit_layer(stacked, ranks, seed)
            tensors.replaced[attention] = stacked_tucker.module_state(unit, fit, context.attn)
            tensors.records.append(fit.relative_error)
            if not fit.converged:
                tensors.unconverged.append((unit.label, fit.relative_error))
    return tensors


def warn_capped(plan: Plan, unconverged: list[tuple[str, float]], total: int) -> None:
    """The loaded methods' warning about fits stopped at their iteration cap, for this run's layers."""
    if isinstance(plan, StackedTuckerPlan):
        headtensor.warn_unconverged(unconverged, total, "stacked Tucker fits", f"{stacked_tucker.MAX_ITERATIONS} sweeps",
                                    stacked_tucker.TOLERANCE)
    elif isinstance(plan, HeadTensorPlan):
        headtensor.warn_unconverged(unconverged, total, f"{plan.method} decompositions",
                                    f"{headtensor.MAX_ITERATIONS} iterations", headtensor.DECOMPOSERS[plan.method].TOLERANCE)


def apply_records(plan: Plan, records: list) -> list[float]:
    """Every layer's records (this run's and those a resumed run read back) into the plan; the unit errors."""
    if isinstance(plan, LokiPlan):
        plan.ranks = list(records)
        return []
    if isinstance(plan, HeadTensorPlan):
        plan.ranks = [tuple(ranks) if ranks else None for _, ranks in records]
        return [error for error, _ in records]
    return list(records)


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
