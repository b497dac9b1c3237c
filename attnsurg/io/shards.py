"""Write a checkpoint's tensors as they are made, each shard as soon as it is complete.

For layer-by-layer surgery: the output's tensor names and shapes are known before any of them is computed (from
the target config, on the meta device), so huggingface_hub plans the shards up front; a shard is written and
its tensors freed the moment its last tensor arrives, and the index is written at the end. Memory holds at
most one shard's worth of finished tensors waiting for the rest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"


def planned_tensors(model_class: type, config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors a ``model_class`` checkpoint of ``config`` saves, as meta tensors in ``dtype`` (a tied output
    head is not saved)."""
    with torch.device("meta"):
        model = model_class(config).to(dtype)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


class ShardWriter:
    """Shards of the tensors ``planned`` (name -> a tensor of the final shape and dtype, meta is enough) in
    ``directory``; ``add`` each tensor once, then ``finish``. The ``flexible`` names' shapes are known only
    when they are added (ranks chosen on data): they are planned at an estimate and take any shape."""

    def __init__(self, directory: Path, planned: dict[str, torch.Tensor], max_shard_size: int | str = "5GB",
                 flexible: Collection[str] = ()):
        self.directory = Path(directory)
        self.planned = {name: (tuple(t.shape), t.dtype) for name, t in planned.items()}
        self.flexible = set(flexible)
        split = split_torch_state_dict_into_shards(planned, max_shard_size=max_shard_size)
        self.sharded = split.is_sharded
        self.file_of = split.tensor_to_filename
        self.waiting: dict[str, dict[str, torch.Tensor]] = {f: {} for f in split.filename_to_tensors}
        self.members = {f: set(names) for f, names in split.filename_to_tensors.items()}
        self.written: list[str] = []
        self.total_size = sum(t.numel() * t.element_size() for t in planned.values())

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.planned:
            raise ValueError(f"tensor '{name}' is not in the planned checkpoint")
        shape, dtype = self.planned[name]
        if tuple(tensor.shape) != shape and name not in self.flexible:
            raise ValueError(f"tensor '{name}' has shape {tuple(tensor.shape)}, planned {shape}")
        filename = self.file_of[name]
        if filename in self.written or name in self.waiting[filename]:
            raise ValueError(f"tensor '{name}' was already added")
        self.waiting[filename][name] = tensor.detach().to("cpu", dtype).contiguous()
        if set(self.waiting[filename]) == self.members[filename]:
            save_file(self.waiting.pop(filename), self.directory / filename, metadata={"format": "pt"})
            self.written.append(filename)

    def progress(self) -> tuple[list[str], dict[str, torch.Tensor]]:
        """The shard files written so far and the tensors waiting for the rest of their shard."""
        return list(self.written), {name: t for waiting in self.waiting.values() for name, t in waiting.items()}

    def restore(self, written: list[str], pending: dict[str, torch.Tensor]) -> None:
        """Continue from an earlier writer's ``progress()`` (its shards already on disk)."""
        for filename in written:
            self.waiting.pop(filename)
            self.written.append(filename)
        for name, tensor in pending.items():
            self.add(name, tensor)

    def finish(self) -> list[str]:
        """Write the index (when sharded); every planned tensor must have been added."""
        missing = sorted(name for filename, waiting in self.waiting.items() for name in self.members[filename] - set(waiting))
        if missing:
            raise ValueError(f"{len(missing)} planned tensors never added, e.g. {missing[:3]}")
        if self.sharded:
            total = self.written_size() if self.flexible else self.total_size
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self.file_of.items()))}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return self.written

    def written_size(self) -> int:
        """The tensors' bytes as written, read from the shards' headers."""
        total = 0
        for filename in self.written:
            with safe_open(str(self.directory / filename), framework="pt") as f:
                for name in f.keys():
                    total += math.prod(f.get_slice(name).get_shape()) * self.planned[name][1].itemsize
        return total
