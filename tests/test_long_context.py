"""A surgery's long-context check (``--eval-long N``): scored on source and result at N tokens, printed, in the
JSON record and on the card; at full budget the result keeps every hit and the late perplexity; lengths too
short for the needles or past the context are one line before any work."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from attnsurg.cli import app

from conftest import build_tiny
from helpers import assert_user_error, fake_assets

LENGTH = 2048


@pytest.fixture
def long_texts(tmp_path, monkeypatch):
    """The built-in stand-ins, with a wiki text long enough for a 2048-token window in its eval part."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ATTNSURG_CACHE", str(cache))
    fake_assets(cache)
    sentences = " ".join(f"The keeper of tower {i} walked to the sea and counted {i * 7} boats." for i in range(60))
    wiki = "".join(f'<doc id="{i}">\nTitle {i}\n\n{sentences}\n</doc>\n' for i in range(12))
    (cache / "text" / "wiki.utf8").write_text(wiki, encoding="utf-8")


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("long") / "llama"
    build_tiny("llama", len(tokenizer), num_key_value_heads=2, max_position_embeddings=LENGTH).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def compress(checkpoint, output, *flags: str):
    return CliRunner().invoke(app, ["compress", str(checkpoint), "--method", "svd", "--calib-tokens", "256",
                                    "--calib-seq-len", "64", "--eval-tokens", "128", "--eval-domains", "none",
                                    "-o", str(output), *flags])


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_full_budget_keeps_every_hit_and_the_late_perplexity(stream, long_checkpoint, long_texts, tmp_path):
    result = compress(long_checkpoint, tmp_path / "out", "--ratio", "1.0", "--eval-long", str(LENGTH), stream, "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout[result.stdout.index("{"):])["long_context"]
    assert record["length"] == LENGTH and record["band"] == "1K-2K" and len(record["hits_before"]) == 16
    assert record["hits_after"] == record["hits_before"]
    assert record["late_ppl_after"] == pytest.approx(record["late_ppl_before"], rel=1e-4)
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"retrieval at {LENGTH} tokens" in card and "ppl at positions 1K-2K" in card


@pytest.mark.parametrize("eval_tokens", ["128", "0"])
@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_the_check_prints_one_line_with_or_without_the_domains(stream, eval_tokens, long_checkpoint, long_texts,
                                                                tmp_path):
    result = compress(long_checkpoint, tmp_path / "out", "--ratio", "0.5", "--eval-long", str(LENGTH), stream,
                      "--eval-tokens", eval_tokens)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("long context"))
    assert line.startswith(f"long context, {LENGTH:,} tokens: retrieval ") and "ppl at positions 1K-2K" in line
    assert f"retrieval at {LENGTH} tokens" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize("length, message", [("4096", "beyond the model's context (2048 positions)"),
                                             ("512", "needs at least 2048")])
def test_a_length_that_cannot_be_checked_is_one_line_before_any_work(length, message, long_checkpoint, long_texts,
                                                                     tmp_path):
    result = compress(long_checkpoint, tmp_path / "out", "--eval-long", length)
    assert_user_error(result, message)
    assert not (tmp_path / "out").exists()
