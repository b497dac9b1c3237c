"""pipelines/card.py: what a run records about how it was started."""

import sys

import pytest

from attnsurg.pipelines.card import command_line


@pytest.mark.parametrize("argv, expected", [
    (["/venv/bin/attnsurg", "convert", "m", "-o", "out dir"], "attnsurg convert m -o 'out dir'"),
    (["/site/attnsurg/__main__.py", "run", "mla-50"], "attnsurg run mla-50"),
    (["quality_matrix.py", "mla-50", "--update", "x.json"], None),  # a script using attnsurg as a library
])
def test_the_card_names_an_attnsurg_command_only_when_one_ran(monkeypatch, argv, expected):
    monkeypatch.setattr(sys, "argv", argv)
    assert command_line() == expected
