"""What a command may write over.

An output path never equals or holds what the command reads (the model, a teacher, a calibration text), never
holds the current directory, and ``--overwrite`` replaces only an earlier output of attnsurg: a directory that
holds one of the files every attnsurg writer leaves in it, or a GGUF file attnsurg exported. Every writer calls
these checks before any long work and again at the moment it replaces the target.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml
from huggingface_hub.repocard import metadata_load

from attnsurg.errors import UserError

# One of these at the top of a directory marks it as written by attnsurg: a checkpoint's recipe (convert,
# compress, heal, streamed or loaded), a built-in asset's completion marker, an analysis, approximation or plan.
OUTPUT_MARKS = ("attnsurg_recipe.yaml", "attnsurg_asset.json", "analysis.json", "approx.json", "plan.json")
GGUF_MARK = "attnsurg.version"  # a GGUF metadata key every export writes


def absolute(path: Path | str) -> Path:
    """The path with ``~``, ``..`` and symbolic links resolved, so two spellings of one place compare equal."""
    return Path(path).expanduser().resolve()


def check_not_a_source(out: Path, reads: Iterable[Path | str]) -> None:
    """Refuse an output that is, or holds, something the command reads, or holds the current directory:
    replacing it would delete what the run depends on."""
    target = absolute(out)
    for read in reads:
        source = absolute(read)
        if target == source:
            raise UserError(f"output '{out}' is '{read}', which this command reads; choose another output")
        if target in source.parents:
            raise UserError(f"output '{out}' holds '{read}', which this command reads; choose another output")
    here = Path.cwd().resolve()
    if target == here or target in here.parents:
        raise UserError(f"output '{out}' is the current directory or holds it; choose a new directory")


def written_by_attnsurg(directory: Path) -> bool:
    """A directory holding one of ``OUTPUT_MARKS``, or a model card tagged ``attnsurg`` (every checkpoint's)."""
    if any((directory / mark).is_file() for mark in OUTPUT_MARKS):
        return True
    card = directory / "README.md"
    try:
        tags = metadata_load(card).get("tags") if card.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return False
    return isinstance(tags, list) and "attnsurg" in tags


def check_output_path(out: Path, overwrite: bool, reads: Iterable[Path | str] = ()) -> None:
    """Refuse an output directory that cannot be written or must not be replaced; call it before any long work
    starts. An empty directory is used as it is; a full one only with ``overwrite`` and only when attnsurg
    wrote it."""
    out = Path(out)
    check_not_a_source(out, reads)
    try:
        if not out.exists():
            return
        if not out.is_dir():
            raise UserError(f"output path '{out}' exists and is a file; choose a directory path")
        if not any(out.iterdir()):
            return
    except PermissionError:
        raise UserError(f"cannot read the output directory '{out}' (permission denied); choose another output") from None
    if not overwrite:
        raise UserError(f"output directory '{out}' already exists; pass --overwrite to replace it")
    if not written_by_attnsurg(out):
        raise UserError(f"output directory '{out}' holds files attnsurg did not write, and --overwrite replaces only "
                        "an earlier attnsurg output; choose another output")


def check_output_file(out: Path, overwrite: bool, reads: Iterable[Path | str] = (),
                      ours: bool | None = None) -> None:
    """The same for an output file (a GGUF): ``ours`` says whether an existing file there is attnsurg's."""
    out = Path(out)
    check_not_a_source(out, reads)
    if out.is_dir():
        raise UserError(f"output '{out}' is a directory; give a file path such as '{out / 'model.gguf'}'")
    if not out.exists():
        if not out.parent.is_dir():
            raise UserError(f"the folder of '{out}' does not exist; create it first")
        return
    if not overwrite:
        raise UserError(f"'{out}' already exists; pass --overwrite to replace it")
    if not ours:
        raise UserError(f"'{out}' is not a file attnsurg exported, and --overwrite replaces only those; "
                        "choose another output")
