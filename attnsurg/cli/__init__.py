"""The ``attnsurg`` command line: thin commands that build a typed request and call the library.

One module per command (or group); each registers itself on the shared Typer app in ``common``.
"""

from __future__ import annotations

from attnsurg.cli import assets, compress, convert, evaluate, export, heal, info, recipes  # noqa: F401  (registers commands)
from attnsurg.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    app(prog_name="attnsurg")
