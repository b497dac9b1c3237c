"""Every attnsurg command README.md shows runs as written, on a tiny stand-in for the demo model and its texts
(the built-in name resolves to a tiny checkpoint in a private asset cache; only sizes are appended)."""

from __future__ import annotations

import random
import re
import shlex
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attnsurg.cli import app, global_options_first, with_aliases
from attnsurg.io.assets import COMPLETE_MARKER

from helpers import fake_assets

README = Path(__file__).parents[1] / "README.md"
DOMAIN_FILES = ("wiki.utf8", "c4.utf8", "code.utf8", "technical.utf8", "multilingual.utf8", "tiny.utf8")
# What the tiny model and texts need instead of the demo's sizes; appended, so the last value given wins.
SMALL = {
    "convert": ["--calib-tokens", "256", "--calib-seq-len", "64", "--refine-steps", "2", "--eval-tokens", "128"],
    "compress": ["--calib-tokens", "256", "--calib-seq-len", "64", "--eval-tokens", "128"],
    "analyze": ["--calib-tokens", "256", "--calib-seq-len", "64", "--eval-tokens", "128", "--methods", "svdllm,loki"],
    "eval": ["--max-tokens", "128", "--max-length", "64"],
    "tasks": ["--passkey-lengths", "192"],
    "export": ["--tokenizer-pre", "gpt-2"],  # the stand-in's tokenizer is not one llama.cpp names
}


def readme_commands(section: str) -> list[list[str]]:
    """The attnsurg commands in a README section's code blocks, continuation lines joined, comments dropped."""
    text = README.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["attnsurg"]:
                    commands.append(words[1:])
    return commands


def sized(command: list[str]) -> list[str]:
    name = "tasks" if command[:2] == ["eval", "tasks"] else command[0]
    return command + SMALL.get(name, [])


def words(rng: random.Random, n: int) -> str:
    vocabulary = "the keeper walked to a lighthouse by sea and it shone at night over ships stone water".split()
    return " ".join(rng.choice(vocabulary) for _ in range(n))


@pytest.fixture
def demo_cache(tmp_path, monkeypatch, tiny_checkpoints) -> Path:
    """An asset cache whose demo model is the tiny Llama and whose six texts are long enough for every command."""
    cache = tmp_path / "cache"
    fake_assets(cache)
    rng = random.Random(0)
    docs = [words(rng, 400) for _ in range(24)]
    texts = {"wiki.utf8": "".join(f'<doc id="{i}">\n{d}\n</doc>\n' for i, d in enumerate(docs)),
             "c4.utf8": "\n".join(docs), "code.utf8": "\n\n\n".join(docs), "technical.utf8": "\n\n".join(docs),
             "multilingual.utf8": "\n".join(docs), "tiny.utf8": "<|endoftext|>".join(docs)}
    for name, text in texts.items():
        (cache / "text" / name).write_text(text, encoding="utf-8")
    model = cache / "models" / "smollm2-135m"
    shutil.copytree(tiny_checkpoints["llama-gqa"], model)
    (model / COMPLETE_MARKER).write_text("{}")
    monkeypatch.setenv("ATTNSURG_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    return cache


def test_the_readme_shows_its_commands():
    assert readme_commands("Quick start")[0][:2] == ["convert", "smollm2-135m"]
    assert {c[0] for c in readme_commands("Tour")} >= {"convert", "eval", "export", "compress", "analyze"}


@pytest.mark.parametrize("section", ["Quick start", "Tour"])
def test_every_readme_command_runs(section, demo_cache):
    runner = CliRunner()
    for command in readme_commands(section):
        result = runner.invoke(app, with_aliases(global_options_first(sized(command))))  # as main() parses argv
        assert result.exit_code == 0, f"attnsurg {shlex.join(command)}\n{result.output[-3000:]}"
