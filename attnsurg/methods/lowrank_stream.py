"""Low-rank compression (svd, asvd, svdllm) and Loki one decoder layer at a time, for models larger than memory.

The same factorization as ``lowrank.compress`` with uniform ranks (or the same key bases as
``loki.apply_loki``, added beside the layer's unchanged weights): each decoder layer is read from the
checkpoint in float32 (``io.lazy``), its attention-input and o_proj-input statistics come from the calibration
windows' residual stream carried from the embeddings through the original layers before it (what one hooked
pass of the loaded model gives), its factors are fitted in float64 and written straight to the output shards
(``io.shards``) with the rest of the layer in the output dtype. Memory holds one source layer, the stream and
at most one shard of finished tensors. ``--allocate`` needs every layer's spectrum before the first rank is
chosen, so it does not stream.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from attnsurg.arch.families import Family
from attnsurg.calibrate import streamed_layers
from attnsurg.io.lazy import CheckpointReader, rotary_embedding
from attnsurg.io.resume import LayerCheckpoints, start_stream
from attnsurg.io.shards import ShardWriter, planned_tensors
from attnsurg.methods.factorized import attnsurg_config
from attnsurg.methods.loki import LokiPlan, layer_basis, planned_surgery
from attnsurg.methods.lowrank import LayerContext, LowRankPlan, decompose, unit_state
from attnsurg.modeling.modeling_attnsurg import CLASSES


@torch.no_grad()
def compress_streamed(
    reader: CheckpointReader,
    source_config: PretrainedConfig,
    family: Family,
    windows: torch.Tensor,
    plan: LowRankPlan | LokiPlan,
    output: Path,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
    progress=None,
    device: torch.device | None = None,
    checkpoints: LayerCheckpoints | None = None,
) -> tuple[PretrainedConfig, list[float]]:
    """Write the compressed model's weights into ``output`` (shards and index; the caller adds config and
    tokenizer); return its config and each unit's relative truncation energy (none for Loki, whose plan gets
    each layer's rank). ``checkpoints``: a checkpoint
    after every layer, and the run resumes from the last one they hold (``io.resume``)."""
    if isinstance(plan, LowRankPlan) and plan.allocate:
        raise ValueError("allocated ranks need every layer's spectrum first; stream with uniform ranks")
    surgery = planned_surgery(plan) if isinstance(plan, LokiPlan) else plan.surgery(family)
    config = attnsurg_config(source_config, surgery)
    config.dtype = str(dtype).removeprefix("torch.")
    writer = ShardWriter(output, planned_tensors(CLASSES[source_config.model_type][1], config, dtype), max_shard_size)
    start = start_stream(reader, family.layers_path.rsplit(".", 1)[0], windows, writer, dtype, config.tie_word_embeddings,
                         checkpoints, config.num_hidden_layers)
    if progress and start.layer:
        progress(start.layer)
    inv_freq = rotary_embedding(source_config).inv_freq
    records = list(start.errors)  # per layer: its units' truncation energies (low-rank) or its rank (Loki)
    hooked = (family.attention_attr, f"{family.attention_attr}.{family.o_proj}")
    for index, layer, (x, o), stream in streamed_layers(reader, source_config, family, start.stream, hooked, device,
                                                        start.layer):
        attention = getattr(layer, family.attention_attr)
        replaced: dict[str, dict[str, torch.Tensor]] = {}
        added: dict[str, torch.Tensor] = {}
        if isinstance(plan, LokiPlan):
            basis, rank = layer_basis(attention, x.offloaded(), plan, inv_freq, windows.shape[1])
            added[f"{family.layers_path}.{index}.{family.attention_attr}.loki_basis"] = basis
            records.append(rank)
        else:
            context = LayerContext(attention, x.offloaded(), o.offloaded(), inv_freq, source_config.num_attention_heads,
                                   source_config.num_key_value_heads, windows.shape[1])
            replaced, errors = factorized_layer(plan, family, index, context)
            records.extend(errors)
        write_layer(writer, f"{family.layers_path}.{index}.", layer, replaced, added)
        if checkpoints:
            checkpoints.save(index + 1, {"stream": stream}, writer, records)
        if progress:
            progress()
    writer.finish()
    if isinstance(plan, LokiPlan):
        plan.ranks = records
        config = attnsurg_config(source_config, plan.surgery())
        config.dtype = str(dtype).removeprefix("torch.")
        return config, []
    return config, records


def factorized_layer(plan: LowRankPlan, family: Family, index: int, context: LayerContext):
    """The factorized modules of decoder layer ``index`` (path -> tensors) and each unit's truncation energy."""
    replaced: dict[str, dict[str, torch.Tensor]] = {}
    errors = []
    for unit, rank in zip(plan.units, plan.ranks, strict=True):
        if unit.layer != index:
            continue
        if rank is None:  # kept dense
            errors.append(0.0)
            continue
        decomposition = decompose(unit, context, plan.method, plan.weighted)
        replaced.update(unit_state(unit, family, *decomposition.factors(rank), decomposition.bias))
        errors.append(decomposition.relative_error(rank))
    return replaced, errors


def write_layer(writer: ShardWriter, prefix: str, layer: torch.nn.Module, replaced: dict[str, dict[str, torch.Tensor]],
                added: dict[str, torch.Tensor] | None = None) -> None:
    """One decoder layer: the factorized modules' tensors, any ``added`` ones (full names), and every other
    tensor of the source layer as it is."""
    for path, tensors in replaced.items():
        for name, tensor in tensors.items():
            writer.add(f"{path}.{name}", tensor)
    for name, tensor in (added or {}).items():
        writer.add(name, tensor)
    for name, tensor in layer.state_dict().items():
        if not any((prefix + name).startswith(path + ".") for path in replaced):
            writer.add(prefix + name, tensor)
