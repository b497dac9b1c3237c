"""Hostile input, generated: whatever a recipe file or a flag holds, the answer is a value or one UserError,
never another exception (which the CLI would print as a traceback)."""

import os
import string

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnsurg.cli.analyze import parse_budgets, parse_layers
from attnsurg.data import parse_datasets
from attnsurg.errors import UserError
from attnsurg.eval.tasks import parse_tasks
from attnsurg.io.recipe_file import parse_recipe
from attnsurg.methods.loki import parse_top_k
from attnsurg.methods.lowrank import parse_targets

FUZZ = settings(max_examples=int(os.environ.get("ATTNSURG_FUZZ_EXAMPLES", 150)), deadline=None, derandomize="ATTNSURG_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow])  # fixed examples in CI; more, random, by hand

VALID = {
    "model": "smollm2-135m",
    "output": "out/x",
    "steps": [{"convert": {"to": "mla", "kv_budget": 0.5}}, {"heal": {"tokens": 1000, "seq_len": 64}}],
    "calibration": {"data": {"dataset": "wiki-sample"}, "tokens": 1024, "seq_len": 128},
    "eval": {"tokens": 0},
    "seed": 0,
}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)


def paths(node, prefix=()):
    """Every key path into a nested recipe, lists included."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from paths(child, (*prefix, key))


def replaced(node, path, value):
    if not path:
        return value
    copy = dict(node) if isinstance(node, dict) else list(node)
    copy[path[0]] = replaced(node[path[0]], path[1:], value)
    return copy


def value_or_user_error(function, *args) -> None:
    try:
        function(*args)
    except UserError as exc:
        assert "\n" not in str(exc).strip(), str(exc)  # one line


@FUZZ
@given(st.text(max_size=300))
def test_any_text_as_a_recipe(text):
    value_or_user_error(parse_recipe, text, "fuzz.yaml")


@FUZZ
@given(st.sampled_from(list(paths(VALID))[1:]), values)
def test_any_value_anywhere_in_a_valid_recipe(path, value):
    value_or_user_error(parse_recipe, yaml.safe_dump(replaced(VALID, path, value)), "fuzz.yaml")


flag_text = st.text(alphabet=string.printable.strip() + " ", max_size=24)  # what a shell passes as one argument


@FUZZ
@given(flag_text)
def test_any_text_as_a_flag_value(text):
    for parse in (parse_layers, parse_budgets, parse_top_k, parse_datasets, parse_targets, parse_tasks):
        value_or_user_error(parse, text)


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_as_a_recipe_file(tmp_path_factory, data):
    from attnsurg.io.recipe_file import load_recipe

    path = tmp_path_factory.mktemp("fuzz") / "fuzz.yaml"
    path.write_bytes(data)
    value_or_user_error(load_recipe, path)


CLI_FUZZ = settings(FUZZ, max_examples=min(FUZZ.max_examples, 25))  # each example runs the command line


@CLI_FUZZ
@given(flag_text, flag_text, st.sampled_from(["--kv-budget", "--calib-seq-len", "--calib-tokens", "--rope-dim", "--kv-rank"]))
def test_any_flag_values_on_the_command_line(tiny_checkpoints, tmp_path_factory, first, second, flag):
    from typer.testing import CliRunner

    from attnsurg.cli import app

    out = tmp_path_factory.mktemp("fuzz") / "out"
    args = ["convert", str(tiny_checkpoints["llama-gqa"]), flag, first, "--calib-dataset", second, "--dry-run", "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 2), (args, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
    assert not out.exists()


CHECKPOINT_FUZZ = settings(FUZZ, max_examples=min(FUZZ.max_examples, 40))  # each example reads a checkpoint


@CHECKPOINT_FUZZ
@given(st.sampled_from(["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                        "head_dim", "vocab_size", "max_position_embeddings", "rope_parameters", "rope_theta",
                        "model_type", "tie_word_embeddings", "intermediate_size"]), values)
def test_any_value_in_a_config(tiny_checkpoints, tmp_path_factory, key, value):
    """A checkpoint whose config.json holds any value anywhere: info reads it or refuses it in one line."""
    import json
    import shutil

    from attnsurg.info import inspect_model
    from attnsurg.requests import ModelRef

    path = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(tiny_checkpoints["llama-gqa"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, key: value}))
    value_or_user_error(inspect_model, ModelRef(ref=str(path)))


@CHECKPOINT_FUZZ
@given(values)
def test_any_shard_index(tiny_checkpoints, tmp_path_factory, index):
    import json
    import shutil

    from attnsurg.io.load import resolve_source

    path = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(tiny_checkpoints["llama-gqa"], path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    value_or_user_error(resolve_source, str(path))


@CHECKPOINT_FUZZ
@given(st.integers(0, 2000), st.binary(min_size=1, max_size=16))
def test_any_damage_to_a_gguf(tiny_gguf, tmp_path_factory, offset, patch):
    """A GGUF cut short or overwritten anywhere in its header and tensor table: read or refused in one line."""
    from attnsurg.io.load import resolve_source

    data = bytearray(tiny_gguf.read_bytes())
    data[offset : offset + len(patch)] = patch
    path = tmp_path_factory.mktemp("fuzz") / "model.gguf"
    path.write_bytes(bytes(data[: max(offset, 8)] if patch[0] % 2 else data))
    value_or_user_error(resolve_source, str(path))
