"""MLA conversion one decoder layer at a time, for models larger than memory.

The same conversion as ``mla.convert`` (closed form from each attention input's second moment, then sequential
refinement), but the source is never loaded whole: each decoder layer is read from the checkpoint in float32
(``io.lazy``), its statistics come from the calibration windows' residual stream carried from the embeddings
through the layers before it, and its converted tensors go straight to the output shards (``io.shards``) in
the output dtype before the next layer is read. Memory holds one source layer, the streams and at most one
shard of finished tensors.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import DeepseekV3ForCausalLM, PretrainedConfig

from attnsurg.arch.families import Family
from attnsurg.calibrate import streamed_layers
from attnsurg.io.lazy import CheckpointReader, rotary_embedding
from attnsurg.io.resume import LayerCheckpoints, StreamStart, start_stream
from attnsurg.io.shards import ShardWriter, planned_tensors
from attnsurg.methods.mla.assemble import attention_state, deepseek_config, padded_heads
from attnsurg.methods.mla.fit import layer_closed_forms
from attnsurg.methods.mla.plan import MLAPlan
from attnsurg.methods.mla.refine import HELD_OUT_SHARE, LayerError, Refinement, SequentialRefiner


@torch.no_grad()
def convert_streamed(
    reader: CheckpointReader,
    source_config: PretrainedConfig,
    family: Family,
    windows: torch.Tensor,
    plan: MLAPlan,
    output: Path,
    weighted: bool = True,
    refinement: Refinement | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
    progress=None,
    device: torch.device | None = None,
    checkpoints: LayerCheckpoints | None = None,
    received: bool = False,
    starts: torch.Tensor | None = None,
) -> tuple[PretrainedConfig, list[LayerError]]:
    """Write the converted model's weights into ``output`` (shards and index; the caller adds config and
    tokenizer) and return its config and each refined layer's errors. ``device``: where the calibration stream
    and refinement run, one layer there at a time. ``checkpoints``: a checkpoint after every layer, and the
    run resumes from the last one they hold (``io.resume``). ``received`` and ``starts``: as in ``mla.convert``."""
    rotary = rotary_embedding(source_config)
    config = deepseek_config(source_config, plan, rotary.inv_freq)
    config.dtype = str(dtype).removeprefix("torch.")
    fitted = deepseek_config(source_config, plan.fitted, rotary.inv_freq)
    fitted._attn_implementation = "sdpa"
    refinement = refinement if refinement and refinement.steps else None
    with ShardWriter(output, planned_tensors(DeepseekV3ForCausalLM, config, dtype), max_shard_size) as writer:
        start = start_stream(reader, family.layers_path.rsplit(".", 1)[0], windows, writer, dtype,
                             config.tie_word_embeddings, checkpoints, config.num_hidden_layers)
        if progress and start.layer:
            progress(start.layer)
        refiner = started_refiner(rotary, family, fitted, start, windows.shape[1], refinement, device, starts)
        errors = [LayerError(*error) for error in start.errors]
        hooked = (family.attention_attr,)
        for index, layer, (statistics,), stream in streamed_layers(reader, source_config, family, start.stream, hooked,
                                                                   device, start.layer, received=hooked if received else (),
                                                                   starts=starts):
            attention = getattr(layer, family.attention_attr)
            weights, *alternatives = layer_closed_forms(attention, statistics, plan, weighted, rotary.inv_freq)
            if refiner:
                weights, error = refiner.refine(index, layer, weights, refinement, alternatives)
                errors.append(error)
            write_layer(writer, f"{family.layers_path}.{index}.", layer, family, weights, plan, dtype)
            if checkpoints:
                checkpoints.save(index + 1, {"stream": stream, **(refiner.carried() if refiner else {})}, writer, errors)
            if progress:
                progress(note=f"layer error {errors[-1].before:.3f} -> {errors[-1].after:.3f}" if errors else "")
        writer.finish()
    return config, errors


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


def write_layer(writer: ShardWriter, prefix: str, layer: torch.nn.Module, family: Family, weights, plan: MLAPlan,
                dtype: torch.dtype) -> None:
    """One converted decoder layer: the new attention, and the source's norms and MLP as they are."""
    attention = getattr(layer, family.attention_attr)
    w, o_weight = padded_heads(weights, attention.o_proj.weight.double(), plan)
    for name, tensor in attention_state(w, o_weight, plan.query_route).items():
        writer.add(f"{prefix}{family.attention_attr}.{name}", tensor.to(dtype))
    for name, tensor in layer.state_dict().items():
        if not name.startswith(f"{family.attention_attr}."):
            writer.add(prefix + name, tensor.to(dtype))
