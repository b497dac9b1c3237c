"""Hostile input, every command: each case is one bad input a careless or hostile user gives. The answer is
exit code 2 and one ``error:`` line naming the problem, never a traceback, never a model, GGUF or score
written, and the source (and anything else already on disk) left exactly as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from attnsurg.cli import app

from helpers import assert_user_error


@dataclass
class Setup:
    """A case's files under ``tmp``: a copy of a tiny checkpoint at ``model``, another (the teacher) at
    ``teacher``, the calibration text, and what the case changed or added."""

    tmp: Path
    model: Path
    teacher: Path
    corpus: Path

    @property
    def calibration(self) -> list[str]:
        return ["--calib-text", str(self.corpus), "--calib-tokens", "256", "--calib-seq-len", "64",
                "--eval-tokens", "0"]

    def as_attnsurg_output(self, path: Path) -> Path:
        """``path`` made to look like an earlier output of attnsurg (its recipe file)."""
        path.mkdir(parents=True, exist_ok=True)
        (path / "attnsurg_recipe.yaml").write_text("model: x\n")
        return path

    def weights(self) -> dict:
        return load_file(self.model / "model.safetensors")

    def save_weights(self, tensors: dict) -> None:
        save_file(tensors, self.model / "model.safetensors", metadata={"format": "pt"})

    def edit_config(self, **changes) -> None:
        config = json.loads((self.model / "config.json").read_text())
        (self.model / "config.json").write_text(json.dumps({**config, **changes}))


def nan_weights(s: Setup) -> None:
    tensors = s.weights()
    name = next(n for n in tensors if "q_proj" in n)
    tensors[name][0, 0] = float("nan")
    s.save_weights(tensors)


def nan_in_the_last_layer(s: Setup) -> None:
    tensors = s.weights()
    tensors[next(n for n in tensors if "layers.1." in n and "q_proj" in n)][0, 0] = float("nan")
    s.save_weights(tensors)


def missing_tensor(s: Setup) -> None:
    tensors = s.weights()
    del tensors[next(n for n in tensors if "layers.1." in n and "k_proj" in n)]
    s.save_weights(tensors)


def more_layers_in_config(s: Setup) -> None:
    s.edit_config(num_hidden_layers=json.loads((s.model / "config.json").read_text())["num_hidden_layers"] + 1)


def fewer_layers_in_config(s: Setup) -> None:
    s.edit_config(num_hidden_layers=1)


def index_with_a_list(s: Setup) -> None:
    (s.model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": []}))


def index_naming_an_absent_tensor(s: Setup) -> None:
    names = {name: "model.safetensors" for name in s.weights()}
    names["model.layers.0.self_attn.q_proj.extra"] = "model.safetensors"
    (s.model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))


def users_folder(s: Setup) -> None:
    (s.tmp / "mine").mkdir()
    (s.tmp / "mine" / "notes.txt").write_text("my notes")


def users_file(s: Setup) -> None:
    (s.tmp / "notes.gguf").write_text("not a GGUF")


def source_is_an_attnsurg_output(s: Setup) -> None:
    s.as_attnsurg_output(s.model)


def parent_is_an_attnsurg_output(s: Setup) -> None:
    s.as_attnsurg_output(s.tmp)


def as_given(s: Setup) -> None:
    """The copies as they are, and a text too short for a window beside them."""
    (s.tmp / "short.txt").write_text("A few words.")


def overflowing_weights(s: Setup) -> None:
    """Finite weights whose MLP activations overflow float16."""
    s.save_weights({name: t * 300 if "mlp" in name else t for name, t in s.weights().items()})


def unknown_rope_type(s: Setup) -> None:
    s.edit_config(rope_parameters={"rope_type": "warp", "rope_theta": 10000.0})


def a_config_claiming_200k_layers(s: Setup) -> None:
    s.edit_config(num_hidden_layers=200_000)


def another_models_tokenizer(s: Setup) -> None:
    """The model embeds 300 tokens; its tokenizer has 384."""
    from conftest import build_tiny

    build_tiny("llama", 300, num_key_value_heads=2).save_pretrained(s.model)


def deep_recipe(s: Setup) -> None:
    (s.tmp / "deep.yaml").write_text("model: " + "[" * 50_000 + "]" * 50_000 + "\n")


def exported_gguf(s: Setup) -> Path:
    from attnsurg.io.gguf_export import export_gguf

    return export_gguf(str(s.model), s.tmp / "model.gguf", tokenizer_pre="gpt-2").path


def a_gguf_cut_short(s: Setup) -> None:
    path = exported_gguf(s)
    path.write_bytes(path.read_bytes()[:4096])


def a_gguf_with_more_blocks_than_it_holds(s: Setup) -> None:
    import gguf

    reader = gguf.GGUFReader(exported_gguf(s), "r+")
    field = reader.fields["llama.block_count"]
    field.parts[field.data[0]][0] = 5
    reader.data.flush()


SVD = ["--method", "svd", "--ratio", "0.5"]

# name: (what the case changes, the command line ({model}, {teacher}, {tmp}, {calib} filled in), a fragment
# of the one error line)
CASES: dict[str, tuple[Callable[[Setup], None], list[str], str]] = {
    # an output that would delete what the run reads, or what the user keeps
    "compress over its own source": (source_is_an_attnsurg_output,
                                     ["compress", "{model}", *SVD, "{calib}", "-o", "{model}", "--overwrite"],
                                     "which this command reads"),
    "convert into the folder above its source": (parent_is_an_attnsurg_output,
                                                 ["convert", "{model}", "{calib}", "-o", "{tmp}", "--overwrite"],
                                                 "which this command reads"),
    "convert streamed over its source": (source_is_an_attnsurg_output,
                                         ["convert", "{model}", "--to", "linear", "--window", "16", "{calib}", "-o",
                                          "{model}", "--overwrite"], "which this command reads"),
    "compress over a folder the user keeps": (users_folder,
                                              ["compress", "{model}", *SVD, "{calib}", "-o", "{tmp}/mine",
                                               "--overwrite"], "attnsurg did not write"),
    "heal over its teacher": (as_given, ["heal", "{model}", "--teacher", "{teacher}", "--text", "{corpus}",
                                        "--tokens", "128", "--seq-len", "32", "--eval-tokens", "0", "-o", "{teacher}",
                                        "--overwrite"], "which this command reads"),
    "heal over its training text": (as_given, ["heal", "{model}", "--teacher", "{teacher}", "--text", "{corpus}",
                                              "--tokens", "128", "--seq-len", "32", "--eval-tokens", "0", "-o",
                                              "{corpus_dir}", "--overwrite"], "which this command reads"),
    "analyze over its source": (source_is_an_attnsurg_output,
                                ["analyze", "{model}", "--text", "{corpus}", "-o", "{model}", "--overwrite"],
                                "which this command reads"),
    "export over a weights file of its source": (as_given, ["export", "{model}", "--gguf", "{model}/model.safetensors",
                                                           "--overwrite"], "not a file attnsurg exported"),
    "export over a file the user keeps": (users_file, ["export", "{model}", "--gguf", "{tmp}/notes.gguf",
                                                       "--overwrite"], "not a file attnsurg exported"),
    "export into a folder": (as_given, ["export", "{model}", "--gguf", "{corpus_dir}"], "is a directory"),
    # a checkpoint that is not whole, on every loaded path
    "a missing tensor, loaded": (missing_tensor, ["compress", "{model}", *SVD, "{calib}", "--no-stream", "-o",
                                                  "{tmp}/out"], "lacks 1 tensor"),
    "a missing tensor, streamed": (missing_tensor, ["compress", "{model}", *SVD, "{calib}", "-o", "{tmp}/out"],
                                   "lacks 1 tensor"),
    "a missing tensor, scored": (missing_tensor, ["eval", "perplexity", "{model}", "--text", "{corpus}",
                                                  "--max-length", "32"], "lacks 1 tensor"),
    "a missing tensor, generated from": (missing_tensor, ["generate", "{model}", "--prompt", "hi"], "lacks 1 tensor"),
    "a missing tensor, exported": (missing_tensor, ["export", "{model}", "--gguf", "{tmp}/m.gguf"], "lacks 1 tensor"),
    "config names more layers than the weights": (more_layers_in_config, ["eval", "perplexity", "{model}", "--text",
                                                                          "{corpus}", "--max-length", "32"],
                                                  "more layers than its weights hold"),
    "weights hold more layers than the config": (fewer_layers_in_config, ["compress", "{model}", *SVD, "{calib}",
                                                                          "--no-stream", "-o", "{tmp}/out"],
                                                 "holds weights of layer 1"),
    "an index whose weight_map is a list": (index_with_a_list, ["info", "{model}"], "no weight_map"),
    "an index naming a tensor its shard lacks": (index_naming_an_absent_tensor, ["info", "{model}"],
                                                 "does not hold it"),
    # NaN weights are never scored, generated from, converted or exported
    "NaN weights, scored": (nan_weights, ["eval", "perplexity", "{model}", "--text", "{corpus}", "--max-length", "32"],
                            "NaN or infinite"),
    "NaN weights, generated from": (nan_weights, ["generate", "{model}", "--prompt", "hi"], "NaN or infinite"),
    "NaN weights, converted": (nan_weights, ["convert", "{model}", "{calib}", "--no-stream", "-o", "{tmp}/out"],
                               "NaN or infinite"),
    "NaN weights in the last layer, streamed (nothing kept to resume into the same failure)": (
        nan_in_the_last_layer, ["compress", "{model}", *SVD, "{calib}", "--stream", "-o", "{tmp}/out"],
        "NaN or infinite"),
    "NaN weights, exported": (nan_weights, ["export", "{model}", "--gguf", "{tmp}/m.gguf", "--tokenizer-pre", "gpt-2"],
                              "NaN or infinite"),
    # settings that would write a broken or untrained model
    "heal with an infinite learning rate": (as_given, ["heal", "{model}", "--teacher", "{teacher}", "--lr", "inf",
                                                      "-o", "{tmp}/out"], "finite number"),
    "heal on a text shorter than one window": (
        as_given, ["heal", "{model}", "--teacher", "{teacher}", "--text", "{tmp}/short.txt", "--seq-len", "64", "-o",
                  "{tmp}/out"], "fewer than one window of 64"),
    "heal past the model's context": (as_given, ["heal", "{model}", "--teacher", "{teacher}", "--text", "{corpus}",
                                                "--seq-len", "100000", "-o", "{tmp}/out"], "past the model's context"),
    "a budget that is not a number": (as_given, ["convert", "{model}", "--kv-budget", "nan", "-o", "{tmp}/out"],
                                      "finite number"),
    "a linear window as long as the calibration windows": (as_given, ["convert", "{model}", "--to", "linear",
                                                                     "--window", "64", "{calib}", "-o", "{tmp}/out"],
                                                           "feature maps would learn nothing"),
    "an unknown llama.cpp pre-tokenizer": (as_given, ["export", "{model}", "--gguf", "{tmp}/m.gguf", "--tokenizer-pre",
                                                     "my-own"], "not a pre-tokenizer llama.cpp knows"),
    "weights that overflow float16, scored": (overflowing_weights, ["eval", "perplexity", "{model}", "--text",
                                                                     "{corpus}", "--max-length", "32", "--dtype",
                                                                     "float16"], "not finite in float16"),
    "weights that overflow float16, generated from": (overflowing_weights, ["generate", "{model}", "--prompt", "hi",
                                                                             "--dtype", "float16"],
                                                      "not finite in float16"),
    # files that parse but hold the wrong thing
    "an unknown RoPE type": (unknown_rope_type, ["info", "{model}"], "RoPE type 'warp'"),
    "a config claiming 200,000 layers": (a_config_claiming_200k_layers, ["info", "{model}"],
                                         "naming 200000 layers, but its weights hold 2"),
    "another model's tokenizer": (another_models_tokenizer, ["eval", "perplexity", "{model}", "--text", "{corpus}",
                                                             "--max-length", "32"], "has 384 tokens but the model embeds 300"),
    "a recipe nested too deeply": (deep_recipe, ["run", "{tmp}/deep.yaml"], "nested too deeply"),
    "a GGUF cut short": (a_gguf_cut_short, ["info", "{tmp}/model.gguf"], "not a readable GGUF file"),
    "a GGUF with more blocks than it holds": (a_gguf_with_more_blocks_than_it_holds,
                                              ["eval", "perplexity", "{tmp}/model.gguf", "--text", "{corpus}",
                                               "--max-length", "32"], "says it has 5 blocks"),
    # options named for what they are
    "--eval-tokens below zero, compress": (as_given, ["compress", "{model}", "--eval-tokens", "-1", "-o", "{tmp}/out"],
                                           "--eval-tokens:"),
    "--eval-tokens below zero, heal": (as_given, ["heal", "{model}", "--teacher", "{teacher}", "--eval-tokens", "-1",
                                                 "-o", "{tmp}/out"], "--eval-tokens:"),
    # the environment
    "a device torch has but attnsurg does not run on": (as_given, ["convert", "{model}", "{calib}", "--device", "xpu",
                                                                  "-o", "{tmp}/out"], "not one attnsurg runs on"),
    "a directory as the calibration text": (as_given, ["convert", "{model}", "--calib-text", "{tmp}", "-o",
                                                      "{tmp}/out"], "is a directory"),
    "/dev/null as the calibration text": (as_given, ["convert", "{model}", "--calib-text", "/dev/null", "-o",
                                                    "{tmp}/out"], "not a regular file"),
}


def digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` by its path, with a hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_input_is_one_line_and_changes_nothing(case, tiny_checkpoints, corpus_file, tmp_path, monkeypatch):
    change, command, fragment = CASES[case]
    workdir = tmp_path / "work"
    workdir.mkdir()
    model, teacher = shutil.copytree(tiny_checkpoints["llama-gqa"], workdir / "model"), tmp_path / "teacher"
    shutil.copytree(tiny_checkpoints["llama-gqa"], teacher)
    (tmp_path / "corpus").mkdir()
    corpus = Path(shutil.copy(corpus_file, tmp_path / "corpus" / "corpus.txt"))
    setup = Setup(workdir, model, teacher, corpus)
    change(setup)
    monkeypatch.chdir(tmp_path)
    before = digest(tmp_path)
    values = {"model": str(model), "teacher": str(teacher), "tmp": str(workdir), "corpus": str(corpus),
              "corpus_dir": str(Path(corpus).parent)}
    args = []
    for part in command:
        args += setup.calibration if part == "{calib}" else [part.format(**values)]
    result = CliRunner().invoke(app, args)
    assert_user_error(result, fragment)
    assert "resume" not in result.stderr  # only an interruption is resumable
    assert digest(tmp_path) == before


@pytest.mark.parametrize("args, fragment", [
    (["convert", "m", "--kv-budget", "abc"], "Invalid value for '--kv-budget'"),
    (["convert", "m", "--kv-budgt", "0.5"], "No such option: --kv-budgt"),
])
def test_a_mistyped_option_or_value_is_one_line(args, fragment):
    """The installed program (not the test runner, which keeps click's own handling) says what was wrong in one
    ``error:`` line, as for every other user error, rather than in click's usage box."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "attnsurg", *args], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith("error: ")
    assert fragment in result.stderr and "--help' lists what it takes" in result.stderr


@pytest.mark.parametrize("command", [
    ["compress", "{model}", *SVD, "{calib}", "--stream", "-o", "{out}"],
    ["compress", "{model}", *SVD, "{calib}", "--no-stream", "-o", "{out}"],
    ["analyze", "{model}", "--text", "{corpus}", "-o", "{out}"],
])
def test_a_read_only_folder_is_one_line(command, tiny_checkpoints, corpus_file, tmp_path, monkeypatch):
    """Every directory a writer makes (the output's folder, the staging or state directory beside it) is made
    inside the code that turns a refused write into one line."""
    import errno
    import os

    made = os.mkdir

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return made(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    values = {"model": str(tiny_checkpoints["llama-gqa"]), "corpus": str(corpus_file), "out": str(tmp_path / "ro" / "out")}
    calibration = Setup(tmp_path, Path(), Path(), corpus_file).calibration
    args = []
    for part in command:
        args += calibration if part == "{calib}" else [part.format(**values)]
    assert_user_error(CliRunner().invoke(app, args), "Read-only file system")


def test_a_file_size_limit_during_export_is_one_line_and_leaves_nothing(tiny_checkpoints, tmp_path):
    """numpy reports a short write without an errno (``N requested and M written``): still one line."""
    import subprocess
    import sys

    args = ["export", str(tiny_checkpoints["llama-gqa"]), "--gguf", str(tmp_path / "out" / "m.gguf"),
            "--tokenizer-pre", "gpt-2"]
    (tmp_path / "out").mkdir()
    code = ("import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
            f"import sys, runpy\nsys.argv = ['attnsurg', *{args!r}]\nrunpy.run_module('attnsurg', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "File too large" in result.stderr and "Traceback" not in result.stderr
    assert list((tmp_path / "out").iterdir()) == []
