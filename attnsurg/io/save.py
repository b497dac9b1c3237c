"""The checkpoint writer every command uses.

Weights go out as sharded safetensors with an index (transformers' ``save_pretrained``, which splits
with huggingface_hub), beside the config, generation config, tokenizer files, a model card and any extra
files (such as the recipe). Everything is written into a temporary directory beside the target and
renamed into place at the end, so a crash never leaves a half-written checkpoint at the target path.
"""

from __future__ import annotations

import errno
import glob
import re
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError
from transformers import PreTrainedModel

from attnsurg.errors import UserError
from attnsurg.io.card import CardInfo, render_card
from attnsurg.io.guard import check_output_path


def write_checkpoint(
    model: PreTrainedModel,
    tokenizer,
    out: Path,
    card: CardInfo,
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    extra_files: Mapping[str, str] | None = None,
    reads: Iterable[Path | str] = (),
) -> Path:
    """Write a complete checkpoint at ``out`` atomically; returns ``out``. ``reads``: what the run read, which
    ``out`` must not replace (``io.guard``)."""
    with staged_checkpoint(out, overwrite, reads) as staging:
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        finish_staging(staging, tokenizer, card, extra_files)
    return Path(out)


@contextmanager
def staged_checkpoint(out: Path, overwrite: bool = False, reads: Iterable[Path | str] = ()) -> Iterator[Path]:
    """A temporary directory beside ``out`` to write a checkpoint into; on success it gets the umask's modes
    and replaces ``out``, on any failure it is removed and ``out`` is untouched."""
    out = Path(out)
    check_output_path(out, overwrite, reads)
    with refused_writes(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_staging(out)
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{staging_prefix(out)}{os.getpid()}-"))
    try:
        with refused_writes(out):
            yield staging
            check_output_path(out, overwrite, reads)  # again: the target may have changed during a long run
            share_as_umask_allows(staging)
            replace_directory(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


WRITE_FAILURES = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.ENOTDIR,
                  errno.EEXIST, errno.ENAMETOOLONG, errno.EISDIR}


def write_failure(exc: BaseException) -> int | None:
    """The errno of a write the machine refused (full disk, size limit, read-only, no permission, a file where
    a folder is needed, a name too long), or None. safetensors' Rust writer reports it only in its text:
    ``... (os error 27)``; numpy's ``tofile`` as ``N requested and M written`` (a full disk or a size limit)."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None and (found := re.search(r"os error (\d+)", str(exc))):
        code = int(found.group(1))
    if code is None and re.search(r"\d+ requested and \d+ written", str(exc)):
        code = errno.EFBIG
    return code if code in WRITE_FAILURES else None


def write_failure_message(out: Path, code: int, where: str = "nothing was left at that path") -> str:
    return f"could not write '{out}': {os.strerror(code)} ({where}; free space or choose another output)"


@contextmanager
def refused_writes(out: Path, where: str = "nothing was left at that path") -> Iterator[None]:
    """A write the machine refuses becomes one ``UserError`` naming ``out`` (and ``where`` the run's files are);
    anything else passes through."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        code = write_failure(exc)
        if code is None:
            raise
        raise UserError(write_failure_message(out, code, where)) from exc


def staging_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def remove_abandoned_staging(out: Path) -> None:
    """Staging directories beside ``out`` whose writer is gone (killed with SIGKILL, or the machine went down:
    nothing ran to remove them) are removed; a live writer's, and any not named with a process id, are left."""
    for staging in out.parent.glob(f"{glob.escape(staging_prefix(out))}*"):
        pid = staging.name.removeprefix(staging_prefix(out)).split("-", 1)[0]
        if staging.is_dir() and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def finish_staging(staging: Path, tokenizer, card: CardInfo, extra_files: Mapping[str, str] | None = None) -> None:
    """Everything but the weights and config: tokenizer files, extra files, the model card."""
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    for name, content in (extra_files or {}).items():
        (staging / name).write_text(content, encoding="utf-8")
    render_card(card).save(staging / "README.md")


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def share_as_umask_allows(root: Path) -> None:
    """Give the staged checkpoint the modes a plain ``mkdir``/``open`` would (the temporary directory is
    created private, 700), so other accounts and serving processes can read it where the umask allows."""
    mask = current_umask()
    root.chmod(0o777 & ~mask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def replace_directory(staging: Path, out: Path) -> None:
    """Move ``staging`` to ``out``; an existing ``out`` is set aside first and removed only after."""
    if not out.exists():
        os.replace(staging, out)
        return
    retired = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.replace(out, retired / out.name)
    os.replace(staging, out)
    shutil.rmtree(retired, ignore_errors=True)
