"""Text for evaluation and calibration, each dataset split into two disjoint parts.

``eval`` and ``calib`` never overlap, so no command can calibrate on the very tokens it is evaluated on.
For the built-in samples the split is by document: the first half of the documents is the evaluation
part, the second half the calibration part. A user's own ``--text`` file is used whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from attnsurg.errors import UserError
from attnsurg.io.assets import ensure_text

Part = Literal["eval", "calib"]
BUILTIN_DATASETS = ("wiki-sample", "c4-sample", "wikitext2")
WIKI_DOC = re.compile(r"<doc[^>]*>(.*?)</doc>", flags=re.S)


@dataclass(frozen=True)
class Text:
    """A named piece of raw text, and which part of its dataset it is."""

    name: str
    part: str
    text: str


def wiki_documents(raw: str) -> list[str]:
    """Articles of wiki.utf8 with their ``<doc ...>`` tags stripped."""
    return [doc.strip() for doc in WIKI_DOC.findall(raw) if doc.strip()]


def line_documents(raw: str) -> list[str]:
    """c4.utf8 holds one document per line."""
    return [line.strip() for line in raw.splitlines() if line.strip()]


def half_of(documents: list[str], part: Part) -> list[str]:
    middle = len(documents) // 2
    return documents[:middle] if part == "eval" else documents[middle:]


def load_dataset_text(name: str, part: Part) -> Text:
    if name == "wiki-sample":
        documents = wiki_documents(ensure_text("wiki-sample").read_text(encoding="utf-8"))
    elif name == "c4-sample":
        documents = line_documents(ensure_text("c4-sample").read_text(encoding="utf-8"))
    elif name == "wikitext2":
        return Text(name, part, wikitext2(part))
    else:
        raise UserError(f"unknown dataset '{name}'; choose one of {', '.join(BUILTIN_DATASETS)} or pass --text PATH")
    return Text(name, part, "\n\n".join(half_of(documents, part)))


def wikitext2(part: Part) -> str:
    """WikiText-2 (raw) through the ``datasets`` library: test split to evaluate, train split to calibrate."""
    try:
        import datasets
    except ImportError:
        raise UserError("--dataset wikitext2 needs the 'datasets' package: pip install 'attnsurg[datasets]'")
    split = "test" if part == "eval" else "train"
    try:
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
    except Exception as exc:  # datasets raises many types for an unreachable hub
        raise UserError(
            f"cannot fetch wikitext2 from the hub ({type(exc).__name__}); with no network use "
            "--dataset wiki-sample or --text PATH"
        )
    return "\n\n".join(rows["text"])


def read_text_file(path: Path) -> Text:
    if not path.is_file():
        raise UserError(f"text file '{path}' does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"text file '{path}' is not UTF-8 (byte {exc.start}); convert it to UTF-8")
    if not text.strip():
        raise UserError(f"text file '{path}' is empty")
    return Text(str(path), "all", text)


def load_text(dataset: str | None, text_path: Path | None, part: Part) -> Text:
    """The text named by ``--dataset`` or ``--text`` (exactly one), restricted to ``part``."""
    if dataset and text_path:
        raise UserError("pass either --dataset or --text, not both")
    if text_path is not None:
        return read_text_file(Path(text_path))
    return load_dataset_text(dataset or "wiki-sample", part)
