"""Every ``attnsurg ... --help`` fits one screen: one short line per option, options grouped in a few panels
named alike across commands, and an epilog of example command lines that parse, plus the guide to read.

The commands are found by walking the app, so a new command or option is held to the same rules."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from attnsurg.cli import app, global_options_first, with_aliases

HELP_CHARS = 60  # an option's help: one line of at most this many characters
SCREEN_LINES = 60  # a command's whole --help at 100 columns
TERMINAL = 80  # and at 80 columns, at most 80 lines
MAX_PANELS = 6  # panels of options in one command's help ("Options", where --help sits, included)
EXAMPLE_CHARS = 78  # an example line, indent included: 80 columns less the epilog's padding
COMMON = [("convert",), ("compress",), ("heal",), ("eval", "perplexity"), ("analyze",)]  # named in the brief
OUTPUT = "Output and safety"
OUTPUT_OPTIONS = {"--dry-run", "--print-recipe", "--overwrite", "--seed", "--device", "--json", "--dtype",
                  "--trust-remote-code", "--allow-pickle"}
# The same spelling names a different text or count in different commands (what heal trains on, what eval
# scores, what analyze reads; heal's distillation temperature and generate's sampling one), so these may sit in
# different panels.
PER_COMMAND_MEANING = {"--dataset", "--text", "--tokens", "--seq-len", "--batch-size", "--warmup", "--methods",
                       "--temperature"}
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.")
README = Path(__file__).resolve().parents[1] / "README.md"


def walk(command, path=()):
    """(path, click command) for the app and every command and group below it."""
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from walk(sub, (*path, name))


ROOT = typer.main.get_command(app)
COMMANDS = dict(walk(ROOT))
LEAVES = [path for path, command in COMMANDS.items() if not hasattr(command, "commands")]


def params(path):
    command = COMMANDS[path]
    ctx = typer.Context(command, info_name=path[-1] if path else "attnsurg")
    return [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]


def render(path, width: int) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(width)}, terminal_width=width,
                                prog_name="attnsurg")
    assert result.exit_code == 0, result.output
    return result.output


def label(path) -> str:
    return " ".join(path) or "attnsurg"


def name(param) -> str:
    return max(param.opts, key=len) if param.opts else param.name


def second_sentence(text: str) -> bool:
    for abbreviation in ABBREVIATIONS:
        text = text.replace(abbreviation, "eg")
    return re.search(r"[.!?;]\s+\S", text) is not None


def test_the_walk_finds_every_command():
    assert len(LEAVES) >= 14 and all(path in COMMANDS for path in COMMON)
    assert ("analyze", "report") in LEAVES and ("eval", "speed") in LEAVES


@pytest.mark.parametrize("path", list(COMMANDS), ids=label)
def test_every_option_help_is_one_short_line_of_one_sentence(path):
    for param in params(path):
        text = getattr(param, "help", None)
        where = f"{label(path)} {name(param)}"
        assert text and text.strip() == text, f"{where}: no help"
        assert "\n" not in text and len(text) <= HELP_CHARS, f"{where}: {len(text)} characters: {text}"
        assert not second_sentence(text), f"{where}: more than one sentence: {text}"


@pytest.mark.parametrize("path", list(COMMANDS), ids=label)
def test_help_says_no_default_that_typer_already_shows(path):
    """'(default 0.5)' belongs in the help only where typer shows no [default: ...] (the option's default is
    None, worked out by the command)."""
    for param in params(path):
        if re.search(r"\bdefault\b", param.help or "", re.IGNORECASE):
            assert param.default in (None, "") or getattr(param, "show_default", None) is False, \
                f"{label(path)} {name(param)}: typer shows the default already: {param.help}"


@pytest.mark.parametrize("path", list(COMMANDS), ids=label)
def test_every_summary_is_one_line(path):
    summary = COMMANDS[path].help or ""
    assert summary and "\n" not in summary.strip() and len(summary) <= EXAMPLE_CHARS, f"{label(path)}: {summary!r}"


@pytest.mark.parametrize("path", sorted(set(COMMON) | set(COMMANDS)), ids=label)
def test_help_fits_one_screen_at_100_columns(path):
    lines = render(path, 100).splitlines()
    assert len(lines) <= SCREEN_LINES, f"{label(path)} --help: {len(lines)} lines at 100 columns"


@pytest.mark.parametrize("path", sorted(set(COMMON) | set(COMMANDS)), ids=label)
def test_help_fits_80_lines_at_80_columns(path):
    lines = render(path, TERMINAL).splitlines()
    assert len(lines) <= TERMINAL, f"{label(path)} --help: {len(lines)} lines at {TERMINAL} columns"


def test_shared_options_sit_in_the_same_panel_everywhere():
    panels: dict[str, dict[str, str | None]] = {}
    for path in LEAVES:
        command_panels = {getattr(p, "rich_help_panel", None) for p in params(path)}
        assert len(command_panels) <= MAX_PANELS, f"{label(path)}: {len(command_panels)} panels"
        for param in params(path):
            panels.setdefault(name(param), {})[label(path)] = getattr(param, "rich_help_panel", None)
    for option in OUTPUT_OPTIONS:
        assert set(panels[option].values()) == {OUTPUT}, f"{option}: {panels[option]}"
    for option, where in panels.items():
        if option not in PER_COMMAND_MEANING:
            assert len(set(where.values())) == 1, f"{option} sits in different panels: {where}"


def test_the_long_commands_group_their_options():
    for path in [p for p in COMMON if p in LEAVES]:
        grouped = [p for p in params(path) if getattr(p, "rich_help_panel", None)]
        assert len(grouped) >= len(params(path)) * 2 // 3, f"{label(path)}: most options in no panel"


def epilog_parts(path):
    """(examples, guide line) of a command's epilog: 'Examples:', indented command lines, 'Guide: ...'."""
    epilog = COMMANDS[path].epilog
    assert epilog, f"{label(path)}: no epilog with examples"
    lines = epilog.splitlines()
    assert lines[0] == "Examples:", f"{label(path)}: {lines[0]!r}"
    return lines[1:-1], lines[-1]


@pytest.mark.parametrize("path", [p for p in COMMANDS if COMMANDS[p].epilog or p in LEAVES], ids=label)
def test_epilog_examples_are_attnsurg_commands_that_parse(path):
    examples, guide = epilog_parts(path)
    assert 2 <= len(examples) <= 4, f"{label(path)}: {len(examples)} examples"
    if path:
        match = re.match(r"Guide: docs/([\w.-]+\.md)\b", guide)
        assert match, f"{label(path)}: last epilog line {guide!r}, not 'Guide: docs/NAME.md'"
        assert f"(docs/{match[1]})" in README.read_text(encoding="utf-8"), f"{match[1]} is not a listed guide"
    rendered = [line.strip() for line in render(path, 80).splitlines()]
    for line in examples:
        assert line.startswith("  ") and len(line) <= EXAMPLE_CHARS, f"{label(path)}: {line!r}"
        example = line.strip()
        assert example in rendered, f"{label(path)}: example not on a line of its own: {example!r}"
        words = shlex.split(example)
        assert words[0] == "attnsurg", f"{label(path)}: {example!r}"
        args = with_aliases(global_options_first(words[1:]))
        result = CliRunner().invoke(app, [*args, "--help"], prog_name="attnsurg", env={"COLUMNS": "100"})
        assert result.exit_code == 0, f"{example!r}: {result.output}"
        usage = next(line for line in result.output.splitlines() if "Usage:" in line)
        assert "COMMAND [ARGS]" not in usage, f"{example!r} names no command: {usage.strip()}"
        shown = usage.split("Usage: attnsurg ", 1)[1].split(" [OPTIONS]")[0].split()
        assert tuple(shown) in LEAVES, f"{example!r}: {usage.strip()}"
