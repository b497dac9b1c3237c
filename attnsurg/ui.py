"""Progress and messages for people, on stderr; results go to stdout.

Live displays switch themselves off when stderr is not a terminal, and ``set_quiet(True)`` silences
them entirely (the CLI's ``--quiet``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from rich.console import Console
from rich.text import Text
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)

# markup=False: no string is ever read as rich markup (paths, model names and exception text may hold
# brackets); styled output is built from Text.
console = Console(stderr=True, markup=False)
_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def info(message: str) -> None:
    if not _quiet:
        console.print(message, highlight=False)


def warn(message: str) -> None:
    """A warning is shown even with --quiet: it says something about the result."""
    console.print(Text.assemble(("warning:", "yellow"), f" {message}"), highlight=False, soft_wrap=True)


def status(message: str):
    """A spinner with a message, for steps of unknown length."""
    if _quiet or not console.is_terminal:
        info(message)
        return nullcontext()
    return console.status(Text(message))


def described(name: str, detail: str) -> Text:
    """A table cell: ``name`` and, dimmed on the next line, ``detail``."""
    return Text.assemble(name, "\n", (detail, "dim"))


@contextmanager
def progress_bar(description: str, total: int, unit: str = "") -> Iterator[callable]:
    """Yield ``advance(n, **fields)``; shows a bar when stderr is a terminal."""
    if _quiet or not console.is_terminal:
        yield lambda n=1, **fields: None
        return
    columns = [
        SpinnerColumn(),
        TextColumn("{task.description}", style="progress.description", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit, markup=False),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}", markup=False),
    ]
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total, note="")
        yield lambda n=1, **fields: bar.update(task, advance=n, **fields)
