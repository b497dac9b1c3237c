"""MLA conversion one decoder layer at a time, for models larger than memory.

The same conversion as ``mla.convert`` (closed form from each attention input's second moment, then sequential
refinement), but the source is never loaded whole: each decoder layer is read from the checkpoint in float32
(``io.lazy``), its statistics come from the calibration windows' residual stream carried from the embeddings
through the layers before it, and its converted tensors go straight to the output shards (``io.shards``) in
the output dtype before the next layer is read. Memory holds one source layer, the streams and at most one
shard of finished tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV3ForCausalLM, PretrainedConfig

from attnsurg.arch.families import Family
from attnsurg.io.lazy import CheckpointReader, rotary_embedding
from attnsurg.io.resume import LayerCheckpoints
from attnsurg.io.shards import planned_tensors
from attnsurg.methods.mla.assemble import deepseek_config
from attnsurg.methods.mla.operator import MLAOperator
from attnsurg.methods.mla.plan import MLAPlan
from attnsurg.methods.mla.refine import LayerError, Refinement
from attnsurg.methods.layerwise import LayerwiseTarget, write_layerwise


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
    operator = MLAOperator(plan, family, source_config, windows.shape[1], weighted, refinement, dtype, device, received,
                           starts)
    target = LayerwiseTarget(output, planned_tensors(DeepseekV3ForCausalLM, config, dtype), dtype, max_shard_size,
                             checkpoints)
    records = write_layerwise(reader, source_config, family, windows, operator, target, progress, device)
    return config, [LayerError(*record) for record in records]
