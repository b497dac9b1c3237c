"""Text for evaluation and calibration, each dataset split into two disjoint parts.

``eval`` and ``calib`` never overlap, so no command can calibrate on the very tokens it is evaluated on.
For the built-in samples the split is by document: the first half of the documents is the evaluation
part, the second half the calibration part. Six built-in domains come from one pinned wheel (wiki, c4,
code, technical, multilingual, stories), so quality can be read off the calibration domain. A user's own
``--text`` file is used whole.
"""

from __future__ import annotations

import difflib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from attnsurg.errors import UserError
from attnsurg.io.assets import ensure_text

Part = Literal["eval", "calib"]
WIKI_DOC = re.compile(r"<doc[^>]*>(.*?)</doc>", flags=re.S)
STORY_END = "<|endoftext|>"
PARAGRAPH_BLOCK_CHARS = 3000
DOCUMENT_ORDER_SEED = 0


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
    """One document per line (c4.utf8; multilingual.utf8, whose lines are passages, and some headings and
    table rows, in one language each: the file holds several passages in many languages, so its two halves
    share no text but can share a story told in another language)."""
    return [line.strip() for line in raw.splitlines() if line.strip()]


def code_documents(raw: str) -> list[str]:
    """code.utf8 separates its files by two or more blank lines (single blank lines occur inside code)."""
    return [doc.strip("\n") for doc in re.split(r"\n{3,}", raw) if doc.strip()]


def story_documents(raw: str) -> list[str]:
    """tiny.utf8 ends every story with ``<|endoftext|>``."""
    return [story.strip() for story in raw.split(STORY_END) if story.strip()]


def paragraph_blocks(raw: str, min_chars: int = PARAGRAPH_BLOCK_CHARS) -> list[str]:
    """technical.utf8 has no document markers: consecutive paragraphs grouped into blocks of at least
    ``min_chars`` characters, so a block keeps a few pages of one text together."""
    blocks: list[str] = []
    current: list[str] = []
    for paragraph in (p.strip() for p in raw.split("\n\n")):
        if paragraph:
            current.append(paragraph)
        if sum(len(p) for p in current) >= min_chars:
            blocks.append("\n\n".join(current))
            current = []
    if current:
        blocks.append("\n\n".join(current))
    return blocks


@dataclass(frozen=True)
class Domain:
    """A built-in text: how its file splits into documents, and whether their order is shuffled (with a
    fixed seed) before halving, for files that group documents by kind (languages, programming languages),
    so both halves and the first evaluation windows mix every kind."""

    name: str
    documents: Callable[[str], list[str]]
    shuffled: bool = False


DOMAINS: dict[str, Domain] = {
    d.name: d
    for d in (
        Domain("wiki-sample", wiki_documents),
        Domain("c4-sample", line_documents),
        Domain("code-sample", code_documents, shuffled=True),
        Domain("technical-sample", paragraph_blocks, shuffled=True),
        Domain("multilingual-sample", line_documents, shuffled=True),
        Domain("stories-sample", story_documents),
    )
}
ALL_DOMAINS = "all"
BUILTIN_DATASETS = (*DOMAINS, "wikitext2")


def half_of(documents: list[str], part: Part) -> list[str]:
    middle = len(documents) // 2
    return documents[:middle] if part == "eval" else documents[middle:]


def domain_documents(domain: Domain) -> list[str]:
    documents = domain.documents(ensure_text(domain.name).read_text(encoding="utf-8"))
    if domain.shuffled:
        random.Random(DOCUMENT_ORDER_SEED).shuffle(documents)
    return documents


def load_dataset_text(name: str, part: Part) -> Text:
    if name == "wikitext2":
        return Text(name, part, wikitext2(part))
    check_dataset_name(name)
    return Text(name, part, "\n\n".join(half_of(domain_documents(DOMAINS[name]), part)))


def check_dataset_name(name: str) -> None:
    if name not in BUILTIN_DATASETS:
        prefixed = [known for known in BUILTIN_DATASETS if name and known.startswith(name)]
        close = prefixed[:1] or difflib.get_close_matches(name, BUILTIN_DATASETS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise UserError(f"unknown dataset '{name}'; {hint}choose from {', '.join(BUILTIN_DATASETS)}, or give a text file")


def parse_datasets(value: str) -> list[str]:
    """A comma-separated list of dataset names, ``all`` for the six built-in domains; checked, in order."""
    names: list[str] = []
    for name in (part.strip() for part in value.split(",") if part.strip()):
        for expanded in DOMAINS if name == ALL_DOMAINS else [name]:
            check_dataset_name(expanded)
            if expanded not in names:
                names.append(expanded)
    if not names:
        raise UserError(f"no dataset named in '{value}'; choose from {', '.join(BUILTIN_DATASETS)} or {ALL_DOMAINS}")
    return names


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
