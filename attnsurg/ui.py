"""Progress and messages for people, on stderr; results go to stdout.

Live displays switch themselves off when stderr is not a terminal, and ``set_quiet(True)`` silences
them entirely (the CLI's ``--quiet``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from rich.console import Console
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)

console = Console(stderr=True)
_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def info(message: str) -> None:
    if not _quiet:
        console.print(message, highlight=False)


def warn(message: str) -> None:
    """A warning is shown even with --quiet: it says something about the result."""
    console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


def status(message: str):
    """A spinner with a message, for steps of unknown length."""
    if _quiet or not console.is_terminal:
        info(message)
        return nullcontext()
    return console.status(message)


@contextmanager
def progress_bar(description: str, total: int, unit: str = "") -> Iterator[callable]:
    """Yield ``advance(n, **fields)``; shows a bar when stderr is a terminal."""
    if _quiet or not console.is_terminal:
        yield lambda n=1, **fields: None
        return
    columns = [
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
    ]
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total, note="")
        yield lambda n=1, **fields: bar.update(task, advance=n, **fields)
