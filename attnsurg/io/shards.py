"""Write a checkpoint's tensors as they are made, each straight into its place in its shard file.

For layer-by-layer surgery: the output's tensor names and shapes are known before any of them is computed (from
the target config, on the meta device), so huggingface_hub plans the shards up front and each shard's
safetensors header (every tensor's dtype, shape and byte range) is known too. A shard file is created with its
header at its final size on the first tensor that belongs to it; each tensor is written into its byte range
when it arrives and freed; the index is written at the end. Memory holds no finished tensors.

Names planned ``flexible`` (ranks chosen on data, so their shapes are known only when they arrive) fix their
shard's header late: that shard's tensors wait in memory until the last one arrives, and the shard is written
whole, as ``safetensors`` writes it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

from attnsurg.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
HEADER_METADATA = {"format": "pt"}
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
LARGEST_WRITE = 1 << 30  # bytes per write call (Linux writes at most about 2 GiB at once)


def planned_tensors(model_class: type, config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors a ``model_class`` checkpoint of ``config`` saves, as meta tensors in ``dtype`` (a tied output
    head is not saved)."""
    with torch.device("meta"):
        model = model_class(config).to(dtype)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


class ShardFile:
    """One shard whose tensors all have known shapes: its header is written first, at the file's final size,
    and each tensor goes into its own byte range as it arrives."""

    def __init__(self, path: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], reopen: bool = False):
        self.path = path
        header, self.ranges = safetensors_layout(tensors)
        self.data_start = 8 + len(header)
        if reopen:  # resuming: the file must be the one this plan writes
            self.handle = open(path, "r+b")
            if self.handle.read(self.data_start) != len(header).to_bytes(8, "little") + header:
                self.handle.close()
                raise UserError(f"'{path}' is not the shard this run writes; remove its directory to start over")
        else:
            self.handle = open(path, "w+b")
            self.handle.write(len(header).to_bytes(8, "little") + header)
            self.handle.truncate(self.data_start + max((end for _, end in self.ranges.values()), default=0))
        self.placed: set[str] = set()

    def place(self, name: str, tensor: torch.Tensor) -> None:
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        begin, end = self.ranges[name]
        assert len(data) == end - begin, name
        offset = self.data_start + begin
        while len(data):
            done = os.pwrite(self.handle.fileno(), data[:LARGEST_WRITE], offset)
            data, offset = data[done:], offset + done
        self.placed.add(name)

    def sync(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        self.handle.close()


def safetensors_layout(tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The safetensors header of ``tensors`` (name -> shape, dtype) and each one's byte range after it: laid out
    as ``safetensors.torch.save_file`` lays them out (larger items first, then by name; the header padded with
    spaces to 8 bytes)."""
    order = sorted(tensors, key=lambda name: (-tensors[name][1].itemsize, name))
    ranges, entries, offset = {}, {"__metadata__": HEADER_METADATA}, 0
    for name in order:
        shape, dtype = tensors[name]
        size = math.prod(shape) * dtype.itemsize
        ranges[name] = (offset, offset + size)
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8), ranges


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
        self.members = {f: set(names) for f, names in split.filename_to_tensors.items()}
        self.buffered = {f for f, names in self.members.items() if names & self.flexible}
        self.waiting: dict[str, dict[str, torch.Tensor]] = {f: {} for f in self.buffered}  # buffered shards only
        self.open: dict[str, ShardFile] = {}  # direct shards being filled
        self.written: list[str] = []
        self.total_size = sum(t.numel() * t.element_size() for t in planned.values())

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.planned:
            raise ValueError(f"tensor '{name}' is not in the planned checkpoint")
        shape, dtype = self.planned[name]
        if tuple(tensor.shape) != shape and name not in self.flexible:
            raise ValueError(f"tensor '{name}' has shape {tuple(tensor.shape)}, planned {shape}")
        filename = self.file_of[name]
        if filename in self.written or name in self.placed_or_waiting(filename):
            raise ValueError(f"tensor '{name}' was already added")
        tensor = tensor.detach().to("cpu", dtype).contiguous()
        if filename in self.buffered:
            self.waiting[filename][name] = tensor
            if set(self.waiting[filename]) == self.members[filename]:
                save_file(self.waiting.pop(filename), self.directory / filename, metadata=HEADER_METADATA)
                self.written.append(filename)
            return
        shard = self.open.get(filename) or self.open_shard(filename)
        shard.place(name, tensor)
        if shard.placed == self.members[filename]:
            shard.close()
            del self.open[filename]
            self.written.append(filename)

    def placed_or_waiting(self, filename: str) -> Collection[str]:
        if filename in self.buffered:
            return self.waiting[filename]
        return self.open[filename].placed if filename in self.open else ()

    def open_shard(self, filename: str, reopen: bool = False) -> ShardFile:
        shapes = {name: self.planned[name] for name in self.members[filename]}
        self.open[filename] = ShardFile(self.directory / filename, shapes, reopen)
        return self.open[filename]

    def progress(self) -> tuple[list[str], dict[str, list[str]], dict[str, torch.Tensor]]:
        """The shard files complete on disk, the shards still being filled with the tensors already in place in
        each, and the tensors waiting in memory for the rest of their (flexible) shard."""
        filling = {filename: sorted(shard.placed) for filename, shard in self.open.items()}
        return list(self.written), filling, {name: t for waiting in self.waiting.values() for name, t in waiting.items()}

    def sync(self) -> None:
        """Flush the shards being filled to the disk (before a checkpoint names the tensors in them)."""
        for shard in self.open.values():
            shard.sync()

    def restore(self, written: list[str], filling: dict[str, list[str]], pending: dict[str, torch.Tensor]) -> None:
        """Continue from an earlier writer's ``progress()`` (its shards on disk, complete or being filled)."""
        for filename in written:
            self.waiting.pop(filename, None)
            self.written.append(filename)
        for filename, placed in filling.items():
            self.open_shard(filename, reopen=True).placed.update(placed)
        for name, tensor in pending.items():
            self.add(name, tensor)

    def close(self) -> None:
        """Close the shards still being filled (a stopped run; complete shards close themselves)."""
        for shard in self.open.values():
            shard.close()
        self.open.clear()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def finish(self) -> list[str]:
        """Write the index (when sharded); every planned tensor must have been added."""
        missing = sorted(name for filename, names in self.members.items() if filename not in self.written
                         for name in names - set(self.placed_or_waiting(filename)))
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
