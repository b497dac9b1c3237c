"""A streamed run that stops resumes from its last finished layer and writes what an uninterrupted run writes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.cli import app
from attnsurg.io.lazy import CheckpointReader
from attnsurg.io.resume import CHECKPOINT_FILE, LayerCheckpoints, state_directory
from attnsurg.methods.headtensor import plan_head_tensor
from attnsurg.methods.loki import plan_loki
from attnsurg.methods.lowrank import plan_lowrank
from attnsurg.methods.compress_layers import compress_streamed
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.methods.mla.refine import Refinement
from attnsurg.methods.mla.stream import convert_streamed

from conftest import with_mean_direction


def tensors_of(directory) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(directory.glob("model*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found.update({f"{path.name}:{name}": f.get_tensor(name) for name in f.keys()})
    return found


class Stop(Exception):
    pass


def stopping_after(layers: int):
    """A progress callback that stops the run once ``layers`` layers are done (after their checkpoint)."""
    done = []

    def progress(n=1, **fields):
        done.append(n)
        if sum(done) >= layers:
            raise Stop

    return progress


def streamed_run(method: str, source, config, windows, out, checkpoints=None, progress=None):
    family = family_for_surgery(config.model_type)
    out.mkdir(exist_ok=True)
    if method == "mla":
        plan = plan_mla(inspect_config(config), kv_budget=0.5)
        return convert_streamed(CheckpointReader(source), config, family, windows, plan, out,
                                refinement=Refinement(4, tokens=4 * 32), max_shard_size="60KB", progress=progress,
                                checkpoints=checkpoints)
    if method == "loki":
        plan = plan_loki(inspect_config(config), None, 0.25, variance=0.9)
    elif method == "tucker":  # at a ratio: each projection's mode ranks chosen on its data
        plan = plan_head_tensor(inspect_config(config), "tucker", "q,k,v,o", ratio=0.4)
    else:
        plan = plan_lowrank(inspect_config(config), "svdllm", "k,v", ratio=0.5, kv_latent=True)
    return compress_streamed(CheckpointReader(source), config, family, windows, plan, out, max_shard_size="60KB",
                             progress=progress, checkpoints=checkpoints)


@pytest.mark.parametrize("method", ["mla", "svdllm", "loki", "tucker"])
def test_a_stopped_run_resumes_where_it_stopped_and_writes_the_same_tensors(method, tiny_checkpoints, tmp_path):
    model = with_mean_direction(AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"]))
    model.save_pretrained(tmp_path / "source", max_shard_size="60KB")  # sharded: layers span files
    windows = torch.randint(0, model.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0))
    whole_config, whole_errors = streamed_run(method, tmp_path / "source", model.config, windows, tmp_path / "whole")

    out = tmp_path / "resumed"
    with pytest.raises(Stop):
        streamed_run(method, tmp_path / "source", model.config, windows, out, LayerCheckpoints(out, "run"), stopping_after(1))
    assert (out / CHECKPOINT_FILE).is_file()
    advanced = []
    config, errors = streamed_run(method, tmp_path / "source", model.config, windows, out, LayerCheckpoints(out, "run"),
                                  lambda n=1, **fields: advanced.append(n))
    assert advanced[0] == 1 and len(advanced) == model.config.num_hidden_layers  # layer 0 was not done again
    assert list(errors) == list(whole_errors) and config.to_dict() == whole_config.to_dict()  # Loki: ranks in config
    whole, resumed = tensors_of(tmp_path / "whole"), tensors_of(out)
    assert whole.keys() == resumed.keys() and len({name.split(":")[0] for name in whole}) > 2
    for name, tensor in whole.items():
        assert torch.equal(tensor, resumed[name]), name
    if method == "tucker":  # shapes the shard plan could not know
        placeholder = plan_head_tensor(inspect_config(model.config), "tucker", "q,k,v,o", ratio=0.4).ranks
        chosen = [tuple(spec["ranks"]) for spec in config.attnsurg["head_tensor"].values()]
        assert len(chosen) == len(placeholder) and chosen != placeholder
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in resumed.values())

    other = LayerCheckpoints(out, "another run's settings")
    assert other.resume_point() is None


STREAM_TINY = ["--method", "svdllm", "--ratio", "0.5", "--stream", "--calib-tokens", "256", "--calib-seq-len", "64",
               "--eval-tokens", "0"]


def test_the_same_command_resumes_other_settings_are_refused_and_overwrite_starts_over(tiny_checkpoints, corpus_file,
                                                                                     tmp_path, monkeypatch):
    import attnsurg.io.resume as resume

    command = ["compress", str(tiny_checkpoints["qwen2"]), *STREAM_TINY, "--calib-text", str(corpus_file)]
    runner = CliRunner()
    assert runner.invoke(app, [*command, "-o", str(tmp_path / "whole")]).exit_code == 0

    out = tmp_path / "out"
    save = resume.LayerCheckpoints.save

    def save_then_stop(self, next_layer, *args):  # as `kill` or a scheduler's preemption stops it
        save(self, next_layer, *args)
        if next_layer == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(resume.LayerCheckpoints, "save", save_then_stop)
    stopped = runner.invoke(app, [*command, "-o", str(out)])
    assert stopped.exit_code != 0 and not out.exists() and "Traceback" not in stopped.stderr
    assert "stopped; the finished layers are kept" in " ".join(stopped.stderr.split())
    monkeypatch.setattr(resume.LayerCheckpoints, "save", save)

    refused = runner.invoke(app, [*command, "--ratio", "0.25", "-o", str(out)])
    assert refused.exit_code == 2 and "other settings" in refused.stderr and not out.exists()
    assert (state_directory(out) / CHECKPOINT_FILE).is_file()

    resumed = runner.invoke(app, [*command, "-o", str(out)])
    assert resumed.exit_code == 0, resumed.output
    assert "resuming at layer 1 of" in resumed.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == ["out"]
    whole, written = tensors_of(tmp_path / "whole"), tensors_of(out)
    assert whole.keys() == written.keys()
    assert all(torch.equal(tensor, written[name]) for name, tensor in whole.items())
    assert {p.name for p in out.iterdir()} == {p.name for p in (tmp_path / "whole").iterdir()}

    monkeypatch.setattr(resume.LayerCheckpoints, "save", save_then_stop)
    runner.invoke(app, [*command, "-o", str(tmp_path / "again")])
    monkeypatch.setattr(resume.LayerCheckpoints, "save", save)
    over = runner.invoke(app, [*command, "--ratio", "0.25", "--overwrite", "-o", str(tmp_path / "again")])
    assert over.exit_code == 0, over.output
    assert "resuming" not in over.stderr and not state_directory(tmp_path / "again").exists()


def stalled_after_its_first_layer(args: list[str], out) -> subprocess.Popen:
    """``attnsurg ARGS`` in a child process that stalls once its first layer's checkpoint is written."""
    stall = ("import time, attnsurg.io.resume as r; save = r.LayerCheckpoints.save\n"
             "def stalled(self, n, *a):\n    save(self, n, *a)\n    time.sleep(600)\n"
             "r.LayerCheckpoints.save = stalled")
    code = f"{stall}\nimport sys, runpy\nsys.argv = ['attnsurg', *{args!r}]\nrunpy.run_module('attnsurg', run_name='__main__')"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (state_directory(out) / CHECKPOINT_FILE).is_file():
        assert child.poll() is None, child.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    return child


def test_kill_9_mid_run_keeps_the_finished_layers_a_second_run_waits_its_turn_and_a_rerun_finishes(
        tiny_checkpoints, corpus_file, tmp_path):
    out = tmp_path / "out"
    args = ["compress", str(tiny_checkpoints["qwen2"]), *STREAM_TINY, "--calib-text", str(corpus_file), "-o", str(out)]
    child = stalled_after_its_first_layer(args, out)
    second = CliRunner().invoke(app, args)
    assert second.exit_code == 2 and "another attnsurg process" in second.stderr
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert not out.exists()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "resuming at layer 1 of" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)


def test_a_run_stopped_before_its_first_layer_is_done_leaves_nothing(tiny_checkpoints, corpus_file, tmp_path, monkeypatch):
    import attnsurg.io.resume as resume

    def fail(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(resume.LayerCheckpoints, "save", fail)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["compress", str(tiny_checkpoints["qwen2"]), *STREAM_TINY, "--calib-text",
                                      str(corpus_file), "-o", str(out)])
    assert result.exit_code != 0 and "resume" not in result.stderr
    assert list(tmp_path.iterdir()) == []

