import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnsurg.errors import UserError
from attnsurg.io.card import CardInfo
from attnsurg.io.save import check_output_path, write_checkpoint

CARD = CardInfo(
    title="tiny test",
    summary="A tiny model written by the test suite.",
    command="attnsurg something --flag",
    recipe_yaml="model: tiny\n",
    figures=[{"metric": "ppl", "before": "10.0", "after": "11.0"}],
)


@pytest.fixture
def tiny(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_sharded_checkpoint_with_card_reloads_identically(tiny, tmp_path):
    model, tokenizer = tiny
    out = write_checkpoint(model, tokenizer, tmp_path / "out", CARD, max_shard_size="60KB", extra_files={"attnsurg_recipe.yaml": "a: 1\n"})
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "README.md", "attnsurg_recipe.yaml"} <= names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    card = (out / "README.md").read_text()
    for expected in ("attnsurg something --flag", "| ppl | 10.0 | 11.0 |", "transformers", "model: tiny"):
        assert expected in card
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.arange(12)[None]
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left behind


def test_existing_output_is_refused_without_overwrite(tiny, tmp_path):
    model, tokenizer = tiny
    out = write_checkpoint(model, tokenizer, tmp_path / "out", CARD)
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="--overwrite"):
        write_checkpoint(model, tokenizer, out, CARD)
    assert (out / "keep.txt").read_text() == "mine"
    write_checkpoint(model, tokenizer, out, CARD, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_overwrite_never_replaces_a_directory_attnsurg_did_not_write(tiny, tmp_path):
    model, tokenizer = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="attnsurg did not write"):
        write_checkpoint(model, tokenizer, out, CARD, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("where", ["source", "parent", "grandparent"])
def test_overwrite_never_replaces_what_the_run_reads(tiny, tmp_path, where):
    model, tokenizer = tiny
    source = write_checkpoint(model, tokenizer, tmp_path / "a" / "b" / "source", CARD)  # an attnsurg output itself
    out = {"source": source, "parent": source.parent, "grandparent": source.parent.parent}[where]
    with pytest.raises(UserError, match="which this command reads"):
        write_checkpoint(model, tokenizer, out, CARD, overwrite=True, reads=[source])
    assert (source / "config.json").is_file()


def test_output_holding_the_current_directory_is_refused(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    out = write_checkpoint(model, tokenizer, tmp_path / "out", CARD)
    monkeypatch.chdir(out)
    with pytest.raises(UserError, match="current directory"):
        write_checkpoint(model, tokenizer, Path("."), CARD, overwrite=True)
    assert (out / "config.json").is_file()


def test_output_path_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        check_output_path(tmp_path / "f", overwrite=True)


def test_crash_while_writing_leaves_nothing_at_the_target(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    out = tmp_path / "out"

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tokenizer, "save_pretrained", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        write_checkpoint(model, tokenizer, out, CARD)
    assert list(tmp_path.iterdir()) == []


def test_crash_during_overwrite_keeps_the_old_checkpoint(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    out = write_checkpoint(model, tokenizer, tmp_path / "out", CARD)
    before = sorted(p.name for p in out.iterdir())
    monkeypatch.setattr(tokenizer, "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        write_checkpoint(model, tokenizer, out, CARD, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("umask,folder,files", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_checkpoint_modes_follow_the_umask(tiny, tmp_path, umask, folder, files):
    import os
    import stat

    model, tokenizer = tiny
    previous = os.umask(umask)
    try:
        out = write_checkpoint(model, tokenizer, tmp_path / "shared", CARD)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == folder
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()} == {files}


def test_a_local_source_card_gives_base_model_and_license(tmp_path):
    from attnsurg.pipelines.card import base_model_id, source_license

    (tmp_path / "README.md").write_text("---\nlicense: mit\nbase_model: org/origin\n---\n\n# a model\n")
    assert base_model_id(str(tmp_path)) == "org/origin" and source_license(str(tmp_path)) == "mit"
    assert base_model_id("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert source_license("smollm2-135m") == "apache-2.0"
    assert base_model_id("org/name") == "org/name" and source_license(str(tmp_path / "none")) is None


@pytest.mark.parametrize("path", ["--no-stream", "--stream"])
def test_a_full_disk_is_one_line_and_leaves_nothing(path, tiny_checkpoints, corpus_file, tmp_path, monkeypatch):
    """ENOSPC while the weights go out, from the loaded model or into the streamed shards: the command says so
    in one line, and neither the target nor a staging directory is left behind."""
    import errno

    from transformers import PreTrainedModel
    from typer.testing import CliRunner

    from attnsurg.cli import app
    from attnsurg.io.shards import ShardWriter

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", disk_full)
    monkeypatch.setattr(ShardWriter, "add", disk_full)
    result = CliRunner().invoke(app, ["compress", str(tiny_checkpoints["qwen2"]), "--method", "svd", "--ratio", "0.5",
                                      "--calib-text", str(corpus_file), "--calib-tokens", "256", "--calib-seq-len", "64",
                                      "--eval-tokens", "0", path, "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "No space left on device" in result.output and "Traceback" not in result.output
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))] == []


def test_staging_left_by_a_killed_writer_is_removed_and_a_live_ones_kept(tiny, tmp_path):
    """kill -9 leaves a staging directory nobody can remove; the next write beside it removes it when its
    writer's process is gone, and never touches one whose writer still runs."""
    import os
    import subprocess

    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = tmp_path / f".out.partial-{finished.pid}-abc"
    live = tmp_path / f".out.partial-{os.getpid()}-def"
    unnamed = tmp_path / ".out.partial-xyz"
    for path in (dead, live, unnamed):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half")
    model, tokenizer = tiny
    write_checkpoint(model, tokenizer, tmp_path / "out", CARD)
    assert not dead.exists() and live.exists() and unnamed.exists()
    assert (tmp_path / "out" / "config.json").is_file()


COMPRESS_TINY = ["--method", "svd", "--ratio", "0.5", "--calib-tokens", "256", "--calib-seq-len", "64", "--eval-tokens", "0",
                 "--eval-domains", "none", "--no-stream"]  # the whole-model writer: its staging, not a streamed run's


def compress_in_a_process(tiny_checkpoints, corpus_file, out, prelude: str, *extra: str):
    """``attnsurg compress`` on a tiny checkpoint in a child process that first runs ``prelude``."""
    import subprocess
    import sys

    args = ["compress", str(tiny_checkpoints["qwen2"]), *COMPRESS_TINY, "--calib-text", str(corpus_file), "-o", str(out), *extra]
    code = f"{prelude}\nimport sys, runpy\nsys.argv = ['attnsurg', *{args!r}]\nrunpy.run_module('attnsurg', run_name='__main__')"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_real_file_size_limit_is_one_line_and_leaves_nothing(tiny_checkpoints, corpus_file, tmp_path):
    """The kernel refuses the weights (RLIMIT_FSIZE: EFBIG, which safetensors reports as its own error)."""
    limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))"
    child = compress_in_a_process(tiny_checkpoints, corpus_file, tmp_path / "out", limit)
    stdout, stderr = child.communicate()
    assert child.returncode == 2, stderr
    assert "File too large" in stderr and "Traceback" not in stderr
    assert [p.name for p in tmp_path.iterdir()] == []


def test_kill_9_while_a_checkpoint_is_written_leaves_the_previous_one_and_a_rerun_succeeds(tiny_checkpoints, corpus_file,
                                                                                         tmp_path):
    import os
    import signal
    import time

    from typer.testing import CliRunner

    from attnsurg.cli import app

    out = tmp_path / "out"
    command = ["compress", str(tiny_checkpoints["qwen2"]), *COMPRESS_TINY, "--calib-text", str(corpus_file), "-o", str(out)]
    assert CliRunner().invoke(app, command).exit_code == 0
    previous = (out / "model.safetensors").read_bytes()
    stall = "import time, attnsurg.io.save as save; save.share_as_umask_allows = lambda path: time.sleep(600)"
    child = compress_in_a_process(tiny_checkpoints, corpus_file, out, stall, "--overwrite", "--seed", "1")
    deadline = time.time() + 300
    while not any(p.name.startswith(".out.partial-") and (p / "model.safetensors").exists() for p in tmp_path.iterdir()):
        assert child.poll() is None, child.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)  # mid-write: the new checkpoint is complete in staging, not yet in place
    child.wait()
    assert (out / "model.safetensors").read_bytes() == previous
    result = CliRunner().invoke(app, [*command, "--overwrite"])
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("name", ["out", "k [x]", "a*b?"])
def test_a_dead_writers_staging_is_removed_whatever_the_output_is_named(tiny, tmp_path, name):
    """A staging directory left by a writer killed with SIGKILL (its process id is gone) is removed by the next
    write beside it, glob characters in the output's name included; a live writer's is left."""
    import os

    from attnsurg.io.save import staging_prefix

    model, tokenizer = tiny
    out = tmp_path / name
    dead = tmp_path / f"{staging_prefix(out)}999999999-abc"
    live = tmp_path / f"{staging_prefix(out)}{os.getpid()}-abc"
    for staging in (dead, live):
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"half")
    write_checkpoint(model, tokenizer, out, CARD)
    assert not dead.exists() and live.is_dir() and (out / "config.json").is_file()
