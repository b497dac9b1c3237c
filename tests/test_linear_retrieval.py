"""Layers kept as softmax attention by measurement (``methods/linear/retrieval.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attnsurg.cli import app

from helpers import streamed_and_loaded
from attnsurg.heads import attention_probabilities
from attnsurg.methods.linear.retrieval import (PROBE_RUNS, PROBE_SEGMENT, copy_attention, induction_probe, most_copying,
                                           second_copy_probabilities)


def test_the_probe_repeats_a_random_segment_after_the_calibration_text():
    windows = torch.arange(1000).view(10, 100)
    probe = induction_probe(windows, vocab_size=50, gap=300, seed=3)
    assert probe.shape == (PROBE_RUNS, 2 * PROBE_SEGMENT + 300)
    assert torch.equal(probe[:, :PROBE_SEGMENT], probe[:, -PROBE_SEGMENT:])
    assert torch.equal(probe[0, PROBE_SEGMENT:-PROBE_SEGMENT], windows.flatten()[:300])
    assert not torch.equal(probe[0, :PROBE_SEGMENT], probe[1, :PROBE_SEGMENT])
    assert torch.equal(induction_probe(windows, 50, 300, seed=3), probe)


def test_a_head_that_attends_after_each_match_copies_fully_and_a_uniform_one_hardly():
    gap = 40
    length = 2 * PROBE_SEGMENT + gap
    copying = torch.zeros(PROBE_SEGMENT, length)
    copying[torch.arange(PROBE_SEGMENT - 1), torch.arange(1, PROBE_SEGMENT)] = 1.0
    uniform = torch.tril(torch.ones(length, length))[-PROBE_SEGMENT:]
    uniform = uniform / uniform.sum(-1, keepdim=True)
    scores = copy_attention(torch.stack([copying, uniform]))
    assert scores[0] == pytest.approx(1.0) and scores[1] < 0.01


@pytest.mark.parametrize("window", [None, 50])
def test_the_second_copys_rows_are_those_of_the_whole_attention(window):
    query, key = torch.randn(3, PROBE_SEGMENT + 90, 8), torch.randn(3, PROBE_SEGMENT + 90, 8)
    whole = attention_probabilities(query, key, 0.3, window)
    assert torch.allclose(second_copy_probabilities(query, key, 0.3, window), whole[:, -PROBE_SEGMENT:], atol=1e-6)


def test_the_most_copying_layers_are_kept_in_layer_order():
    assert most_copying([0.1, 0.9, 0.05, 0.7, 0.2], 2) == (1, 3)
    assert most_copying([0.1, 0.9], 0) == ()


def test_the_command_keeps_the_layers_it_measured_streamed_or_loaded(tiny_checkpoints, corpus_file, tmp_path):
    common = ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear", "--window", "8", "--transfer-steps", "3",
              "--retrieval-layers", "1", "--calib-text", str(corpus_file), "--calib-tokens", "768", "--calib-seq-len", "64",
              "--eval-domains", "none", "--json"]
    records, _ = streamed_and_loaded(common, tmp_path)
    plans = {mode: record["plan"] for mode, record in records.items()}
    copying = plans["--stream"]["copying"]
    assert len(copying) == 2 and plans["--stream"]["full_layers"] == [max(range(2), key=lambda i: copying[i])]
    assert plans["--no-stream"]["full_layers"] == plans["--stream"]["full_layers"]
    assert plans["--no-stream"]["copying"] == pytest.approx(copying, abs=1e-5)
    config = json.loads((tmp_path / "--stream" / "config.json").read_text())
    assert config["attnsurg"]["linear"]["full_layers"] == plans["--stream"]["full_layers"]
    dry = CliRunner().invoke(app, [*common, "--dry-run"])  # the cache is known before the layers are chosen
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["plan"]["cache_values"] == plans["--stream"]["cache_values"]


def test_layers_given_both_by_index_and_by_count_are_one_line(tiny_checkpoints, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear", "--full-layers", "1",
                                      "--retrieval-layers", "1", "-o", str(tmp_path / "x")])
    assert result.exit_code == 2 and result.output.startswith("error: ") and result.output.count("\n") == 1
    assert "--retrieval-layers" in result.output
