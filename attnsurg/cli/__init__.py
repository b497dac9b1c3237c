"""The ``attnsurg`` command line: thin commands that build a typed request and call the library.

One module per command (or group); each registers itself on the shared Typer app in ``common``.
"""

from __future__ import annotations

import sys

import typer

from attnsurg.cli import (  # noqa: F401  (registers commands)
    analyze, assets, compress, convert, evaluate, export, generate, heal, info, recipes,
)
from attnsurg.cli.common import app, print_error
from attnsurg.errors import UserError

__all__ = ["app", "main"]


USAGE_ERROR = typer.BadParameter.__base__  # click's UsageError (typer vendors click; every parsing error is one)


def main() -> None:
    """The ``attnsurg`` program: a mistyped option or value is one ``error:`` line and exit code 2, as every
    other user error is, rather than click's usage box."""
    args = with_aliases(global_options_first(sys.argv[1:]))
    try:
        code = app(args=args, prog_name="attnsurg", standalone_mode=False)
    except USAGE_ERROR as exc:
        command = exc.ctx.command_path if exc.ctx is not None else "attnsurg"
        print_error(f"{exc.format_message().rstrip('.')} ('{command} --help' lists what it takes)")
        sys.exit(UserError.exit_code)
    except typer.Abort:
        print_error("interrupted")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


# One vocabulary: --dataset/--text/--tokens/--seq-len name the text a command reads; the surgery commands read
# two (calibration and evaluation), so theirs are --calib-*. The other spelling is taken in each, unlisted.
CALIBRATING = {"--dataset": "--calib-dataset", "--text": "--calib-text", "--tokens": "--calib-tokens",
               "--seq-len": "--calib-seq-len"}
ALIASES = {
    ("convert",): CALIBRATING,
    ("compress",): CALIBRATING,
    ("analyze", "plan"): CALIBRATING,
    ("heal",): {calib: plain for plain, calib in CALIBRATING.items()},
}


def with_aliases(args: list[str]) -> list[str]:
    """The command's own spelling for an option given in another command's (``heal --calib-dataset c4``)."""
    words = [a for a in args if not a.startswith("-")][:2]
    aliases = ALIASES.get(tuple(words[:1])) or ALIASES.get(tuple(words), {})
    if not aliases or "--" in args:
        return args
    renamed = []
    for index, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        is_value = index > 0 and args[index - 1] in {*aliases, *aliases.values()}  # `--calib-text --text`: a file
        renamed.append(arg if is_value else aliases.get(flag, flag) + equals + value)
    return renamed


def global_options_first(args: list[str]) -> list[str]:
    """``--quiet``/``-q`` belong to attnsurg itself; given after the command (``attnsurg info M --quiet``) they
    are moved before it rather than refused as unknown."""
    if "--" in args:
        return args
    quiet = [a for a in args if a in ("--quiet", "-q")]
    return quiet[:1] + [a for a in args if a not in ("--quiet", "-q")]
