"""The checkpoint writer every command uses.

Weights go out as sharded safetensors with an index (transformers' ``save_pretrained``, which splits
with huggingface_hub), beside the config, generation config, tokenizer files, a model card and any extra
files (such as the recipe). Everything is written into a temporary directory beside the target and
renamed into place at the end, so a crash never leaves a half-written checkpoint at the target path.
"""

from __future__ import annotations

import errno
import re
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError
from transformers import PreTrainedModel

from attnsurg.errors import UserError
from attnsurg.io.card import CardInfo, render_card


def check_output_path(out: Path, overwrite: bool) -> None:
    """Refuse an existing target unless ``overwrite``; call it before any long work starts."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"output path '{out}' exists and is a file; choose a directory path")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"output directory '{out}' already exists; pass --overwrite to replace it")


def write_checkpoint(
    model: PreTrainedModel,
    tokenizer,
    out: Path,
    card: CardInfo,
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Write a complete checkpoint at ``out`` atomically; returns ``out``."""
    with staged_checkpoint(out, overwrite) as staging:
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        finish_staging(staging, tokenizer, card, extra_files)
    return Path(out)


@contextmanager
def staged_checkpoint(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """A temporary directory beside ``out`` to write a checkpoint into; on success it gets the umask's modes
    and replaces ``out``, on any failure it is removed and ``out`` is untouched."""
    out = Path(out)
    check_output_path(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_staging(out)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{staging_prefix(out)}{os.getpid()}-"))
    try:
        yield staging
        share_as_umask_allows(staging)
        replace_directory(staging, out)
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        code = write_failure(exc)
        if code is not None:
            raise UserError(f"could not write '{out}': {os.strerror(code)} (nothing was left at that path; "
                            "free space or choose another output)") from exc
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


WRITE_FAILURES = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def write_failure(exc: BaseException) -> int | None:
    """The errno of a write the machine refused (full disk, size limit, read-only, no permission), or None.
    safetensors' Rust writer reports it only in its text: ``... (os error 27)``."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None and (found := re.search(r"os error (\d+)", str(exc))):
        code = int(found.group(1))
    return code if code in WRITE_FAILURES else None


def staging_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def remove_abandoned_staging(out: Path) -> None:
    """Staging directories beside ``out`` whose writer is gone (killed with SIGKILL, or the machine went down:
    nothing ran to remove them) are removed; a live writer's, and any not named with a process id, are left."""
    for staging in out.parent.glob(f"{staging_prefix(out)}*"):
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
