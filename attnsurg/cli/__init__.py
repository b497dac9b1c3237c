"""The ``attnsurg`` command line: thin commands that build a typed request and call the library.

One module per command (or group); each registers itself on the shared Typer app in ``common``.
"""

from __future__ import annotations

import sys

from attnsurg.cli import analyze, assets, compress, convert, evaluate, export, heal, info, recipes  # noqa: F401  (registers commands)
from attnsurg.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    app(args=global_options_first(sys.argv[1:]), prog_name="attnsurg")


def global_options_first(args: list[str]) -> list[str]:
    """``--quiet``/``-q`` belong to attnsurg itself; given after the command (``attnsurg info M --quiet``) they
    are moved before it rather than refused as unknown."""
    if "--" in args:
        return args
    quiet = [a for a in args if a in ("--quiet", "-q")]
    return quiet[:1] + [a for a in args if a not in ("--quiet", "-q")]
