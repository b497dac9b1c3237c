"""Streamed surgery that resumes where it stopped.

A layer-by-layer run (``--stream``) of an 8B model takes hours on a CPU and a 70B one days; a run that stops
(killed, out of memory, the machine went down) would otherwise start again from the first layer. A streamed run
therefore writes into a state directory beside its target, ``OUT.stream-state``: the output's shards, each tensor
into its place as it is made, and, after each decoder layer, one checkpoint file holding what the next layer needs:
the residual streams carried from layer to layer, which tensors are in place in the shards being filled (and any
finished tensors waiting in memory for a shard whose shapes come late), the layer errors so far and a fingerprint
of the settings. The checkpoint replaces its predecessor atomically, so a run stopped at any moment resumes from
the last layer it finished, and writes what an uninterrupted run writes. Running the same command again resumes;
other settings are refused (or, with ``--overwrite``, start over). When the last layer is done the directory gets
its config, tokenizer and card and is renamed into place.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from attnsurg import __version__, ui
from attnsurg.errors import UserError
from attnsurg.io.guard import check_output_path
from attnsurg.io.save import refused_writes, replace_directory, share_as_umask_allows, write_failure, write_failure_message
from attnsurg.io.shards import ShardWriter

STATE_SUFFIX = ".stream-state"
CHECKPOINT_FILE = "resume.safetensors"
LOCK_FILE = "resume.lock"
CARRIED, PENDING = "carried/", "pending/"  # name prefixes of the two kinds of tensor in the checkpoint


def state_directory(out: Path) -> Path:
    out = Path(out)
    return out.parent / f"{out.name}{STATE_SUFFIX}"


def settings_fingerprint(settings: dict, windows: torch.Tensor, source: Path) -> str:
    """What decides a streamed run's output: its settings, its calibration token ids, the source checkpoint's
    files (names, sizes, modification times; ``source`` a directory, one .gguf file or a hub id) and this
    version of attnsurg."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(windows.to(torch.int64).contiguous().numpy().tobytes())
    source = Path(source)
    digest.update(str(source).encode())
    for path in [source] if source.is_file() else sorted(source.iterdir()) if source.is_dir() else []:
        if path.is_file() and path.suffix in (".safetensors", ".json", ".gguf"):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update(__version__.encode())
    return digest.hexdigest()


@dataclass
class ResumePoint:
    """Where a stopped run left off: the next decoder layer to operate on and what it needs."""

    next_layer: int
    carried: dict[str, torch.Tensor]  # residual streams, as the next layer receives them
    errors: list  # each finished layer's error record (JSON values)
    written: list[str]  # shard files complete on disk
    filling: dict[str, list[str]]  # shard files still being filled -> the tensors in place in each
    pending: dict[str, torch.Tensor]  # finished tensors waiting in memory for their shard


class LayerCheckpoints:
    """The checkpoint of one streamed run in its state directory (shards are written there too)."""

    def __init__(self, directory: Path, fingerprint: str):
        self.directory, self.fingerprint = Path(directory), fingerprint
        self.path = self.directory / CHECKPOINT_FILE
        self.synced: set[str] = set()  # shard files already flushed to disk

    def stored_fingerprint(self) -> str | None:
        if not self.path.is_file():
            return None
        try:
            with safe_open(str(self.path), framework="pt") as f:
                return json.loads(f.metadata()["progress"])["fingerprint"]
        except (OSError, SafetensorError, KeyError, ValueError):
            return None  # unreadable: treated as no checkpoint

    def resume_point(self) -> ResumePoint | None:
        """The last finished layer's state, when the directory holds one of this run's settings."""
        if self.stored_fingerprint() != self.fingerprint:
            return None
        carried, pending = {}, {}
        with safe_open(str(self.path), framework="pt") as f:
            progress = json.loads(f.metadata()["progress"])
            for name in f.keys():
                kind = carried if name.startswith(CARRIED) else pending
                kind[name.split("/", 1)[1]] = f.get_tensor(name)
        filling = progress.get("filling", {})
        missing = sorted(name for name in [*progress["written"], *filling] if not (self.directory / name).is_file())
        if missing:
            raise UserError(f"'{self.directory}' lacks the shard {missing[0]} its checkpoint lists; remove the "
                            "directory to start over")
        return ResumePoint(progress["next_layer"], carried, progress["errors"], progress["written"], filling, pending)

    def save(self, next_layer: int, carried: dict[str, torch.Tensor], writer: ShardWriter, errors: list) -> None:
        """Record that every layer before ``next_layer`` is done; replaces the previous checkpoint atomically."""
        written, filling, pending = writer.progress()
        tensors = {CARRIED + name: t.detach().cpu().contiguous() for name, t in carried.items()}
        tensors.update({PENDING + name: t for name, t in pending.items()})
        progress = {"fingerprint": self.fingerprint, "next_layer": next_layer, "errors": errors, "written": written,
                    "filling": filling}
        writer.sync()  # on disk before a checkpoint names them, should the machine go down
        for name in written:
            if name not in self.synced:
                synced_to_disk(self.directory / name)
                self.synced.add(name)
        staging = self.path.with_suffix(".tmp")
        save_file(tensors, staging, metadata={"progress": json.dumps(progress)})
        synced_to_disk(staging)
        os.replace(staging, self.path)
        synced_to_disk(self.directory)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
        (self.directory / LOCK_FILE).unlink(missing_ok=True)


@contextmanager
def resumable_checkpoint(out: Path, overwrite: bool, fingerprint: str,
                         reads: Iterable[Path | str] = ()) -> Iterator[LayerCheckpoints]:
    """The state directory of a streamed run writing ``out``: resumed when it holds this run's checkpoint,
    emptied when it holds nothing usable, refused when it holds another run's (unless ``overwrite``). On
    success it is completed by the caller, then renamed to ``out``; on an interruption it stays, to be resumed,
    when it holds a finished layer; on a failure that would recur it is removed."""
    out = Path(out)
    check_output_path(out, overwrite, reads)
    directory = state_directory(out)
    with refused_writes(out):
        directory.mkdir(parents=True, exist_ok=True)
    with held_lock(directory):
        checkpoints = LayerCheckpoints(directory, fingerprint)
        stored = checkpoints.stored_fingerprint()
        if stored is not None and stored != fingerprint and not overwrite:
            raise UserError(f"'{directory}' holds an unfinished streamed run with other settings or another source; "
                            "run that command again to finish it, or pass --overwrite to start this one over")
        if stored != fingerprint:
            empty_except(directory, LOCK_FILE)
        try:
            with sigterm_as_interrupt():
                yield checkpoints
            check_output_path(out, overwrite, reads)  # again: the target may have changed during a long run
            share_as_umask_allows(directory)
            replace_directory(directory, out)  # the checkpoint goes last: a failed rename can still be resumed
        except BaseException as exc:
            stopped(exc, checkpoints, out)
            raise
        LayerCheckpoints(out, fingerprint).clear()


RESUMABLE = (KeyboardInterrupt, MemoryError, OSError, SafetensorError)  # what a second run may get past


def stopped(exc: BaseException, checkpoints: LayerCheckpoints, out: Path) -> None:
    """A run that was interrupted (Ctrl-C, SIGTERM, out of memory, a refused write) keeps its state when a layer
    was finished, and says so; one that failed in a way a rerun would repeat (a bad tensor, a refused setting,
    a bug) keeps nothing, so no rerun "resumes" into the same failure."""
    kept = isinstance(exc, RESUMABLE) and not isinstance(exc, UserError) and checkpoints.path.is_file()
    if not kept:
        shutil.rmtree(checkpoints.directory, ignore_errors=True)
    where = (f"the finished layers are kept in '{checkpoints.directory}'; run the same command again to resume"
             if kept else "nothing was left at that path")
    code = write_failure(exc) if isinstance(exc, (OSError, SafetensorError)) else None
    if code is not None:
        raise UserError(write_failure_message(out, code, where)) from exc
    if kept:
        ui.warn(f"stopped; {where}")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (`kill`, a scheduler preempting the job) stops the run as Ctrl-C does: the state is kept and the
    run says where, instead of ending without a word."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def synced_to_disk(path: Path) -> None:
    """Flush a file's (or a directory's entries') writes to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextmanager
def held_lock(directory: Path) -> Iterator[None]:
    """One process at a time per state directory (an advisory lock, released when its holder dies)."""
    handle = open(directory / LOCK_FILE, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another attnsurg process is writing '{directory}'; wait for it to finish") from None
        yield
    finally:
        handle.close()


def empty_except(directory: Path, keep: str) -> None:
    for path in directory.iterdir():
        if path.name == keep:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


@dataclass
class StreamStart:
    """Where a streamed surgery starts: the first layer to operate on, its input on every calibration window,
    what else the method carries (its own streams) and the errors of the layers before it."""

    layer: int
    stream: torch.Tensor
    carried: dict[str, torch.Tensor]
    errors: list


def start_stream(reader, top: str, windows: torch.Tensor, writer: ShardWriter, dtype: torch.dtype, tied: bool,
                 checkpoints: LayerCheckpoints | None = None, num_layers: int | None = None,
                 scale: float = 1.0) -> StreamStart:
    """Resume from ``checkpoints`` when they hold this run's state; otherwise write the tensors outside the
    decoder layers (embeddings, final norm, output head; ``top`` is their module, "model") and start the stream
    at the embeddings of the calibration ``windows``, times the family's embedding ``scale``
    (``io.lazy.embedding_scale``)."""
    point = checkpoints.resume_point() if checkpoints else None
    if point is not None:
        writer.restore(point.written, point.filling, point.pending)
        ui.info(f"resuming at layer {point.next_layer} of {num_layers} from '{checkpoints.directory}'")
        return StreamStart(point.next_layer, point.carried.pop("stream"), point.carried, point.errors)
    embed = reader.tensor(f"{top}.embed_tokens.weight")  # as stored: no float32 copy of the vocabulary
    stream = embed[windows].float()
    if scale != 1.0:
        stream *= scale
    writer.add(f"{top}.embed_tokens.weight", embed)  # cast to dtype by the writer
    del embed
    writer.add(f"{top}.norm.weight", reader.tensor(f"{top}.norm.weight", dtype))
    if not tied:
        head = "lm_head.weight" if "lm_head.weight" in reader.weight_map else f"{top}.embed_tokens.weight"
        writer.add("lm_head.weight", reader.tensor(head, dtype))
    return StreamStart(0, stream, {}, [])
