import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import attnsurg
from attnsurg.cli import app

from helpers import assert_user_error, fake_assets

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and attnsurg.__version__ in result.stdout


def test_python_dash_m_works():
    result = subprocess.run([sys.executable, "-m", "attnsurg", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and "attnsurg" in result.stdout


def test_info_table_and_json(tiny_checkpoints, corpus_file, tmp_path):
    path = tiny_checkpoints["qwen2"]
    table = invoke("info", path)
    assert table.exit_code == 0
    for fragment in ("qwen2", "GQA", "q, k, v", "KV bytes per token (float32)", "512"):
        assert fragment in table.stdout
    record = json.loads(invoke("info", path, "--json").stdout)
    assert record["anatomy"]["num_kv_heads"] == 2 and record["anatomy"]["kv_bytes_per_token"] == 512
    assert record["methods"]["mla"] is None
    mla_output = tmp_path / "mla"
    assert invoke("convert", path, "--kv-budget", "0.5", "--calib-text", corpus_file, "--calib-tokens", "256",
                  "--refine-steps", "0", "--eval-tokens", "0", "-o", mla_output).exit_code == 0
    converted = json.loads(invoke("info", mla_output, "--json").stdout)
    assert converted["anatomy"]["attention_kind"] == "mla" and converted["methods"]["mla"] is not None


def test_eval_two_models_table_and_json(tiny_checkpoints, corpus_file):
    a, b = tiny_checkpoints["llama-gqa"], tiny_checkpoints["mistral"]
    args = ["eval", "perplexity", a, b, "--text", corpus_file, "--max-length", "128", "--max-tokens", "512", "--device", "cpu"]
    table = invoke(*args)
    assert table.exit_code == 0, table.output
    assert "disjoint" in table.stdout and "1.0000" in table.stdout
    record = json.loads(invoke(*args, "--json").stdout)
    assert [r["tokens_scored"] for r in record["results"]] == [508, 508]
    assert record["results"][0]["ratio"] == 1.0
    strided = json.loads(invoke(*args, "--stride", "64", "--json").stdout)
    assert strided["stride"] == 64 and strided["results"][0]["tokens_scored"] == 511
    same_words = ["eval", "perplexity", a, b, "--text", corpus_file, "--seq-len", "128", "--tokens", "512", "--device", "cpu"]
    again = json.loads(invoke(*same_words, "--json").stdout)["results"]  # the names surgery commands use
    assert [(r["ppl"], r["tokens_scored"]) for r in again] == [(r["ppl"], r["tokens_scored"]) for r in record["results"]]


def test_assets_listing(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    result = invoke("assets")
    assert result.exit_code == 0 and "smollm2-135m" in result.stdout and "not fetched" in result.stdout
    record = json.loads(invoke("assets", "list", "--json").stdout)
    assert record["cache_dir"] == str(tmp_path)


# ------------------------------------------------------------------------------------------ bad input
def test_missing_path():
    assert_user_error(invoke("info", "./does/not/exist"), "does not exist")


def test_directory_that_is_not_a_checkpoint(tmp_path):
    assert_user_error(invoke("eval", "perplexity", tmp_path), "not a checkpoint directory")


def test_unsupported_architecture(tmp_path):
    from transformers import T5Config

    T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=32).save_pretrained(tmp_path)
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    assert_user_error(invoke("info", tmp_path), "not a causal language model", "Qwen2 (qwen2)")


def test_calibration_data_is_checked_before_anything_loads(tmp_path):
    """A dry run loads no weights, so these fail in it: the data was checked when the request was made."""
    assert_user_error(invoke("convert", "smollm2-135m", "--calib-dataset", "wikki-sample", "-o", tmp_path / "o", "--dry-run"),
                      "--calib-dataset: unknown dataset 'wikki-sample'; did you mean 'wiki-sample'?")
    assert_user_error(invoke("compress", "smollm2-135m", "--method", "svd", "--calib-text", tmp_path / "none.txt", "-o",
                             tmp_path / "o", "--dry-run"), "--calib-text: text file")


def test_truncated_weights_and_a_mistyped_builtin_name(tmp_path, tiny_checkpoints):
    shutil.copytree(tiny_checkpoints["llama-gqa"], tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    assert_user_error(invoke("eval", "perplexity", tmp_path / "m"), "not a readable safetensors file")
    assert_user_error(invoke("info", "smollm2"), "did you mean smollm2-135m?")


def test_pickle_without_allow_pickle(tmp_path, tiny_checkpoints):
    shutil.copy(tiny_checkpoints["llama-gqa"] / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert_user_error(invoke("info", tmp_path), "--allow-pickle")


def test_remote_code_without_flag(tmp_path, tiny_checkpoints):
    config = json.loads((tiny_checkpoints["llama-gqa"] / "config.json").read_text())
    config.update(model_type="custom_llm", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_user_error(invoke("info", tmp_path), "--trust-remote-code")


@pytest.mark.parametrize(
    "content,fragment", [(b"", "is empty"), (b"caf\xe9 au lait", "not UTF-8"), (b"just a few words", "shorter than one window")]
)
def test_bad_text_files(tmp_path, tiny_checkpoints, content, fragment):
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    result = invoke("eval", "perplexity", tiny_checkpoints["llama-gqa"], "--text", path, "--max-length", "64")
    assert_user_error(result, fragment)


def test_window_longer_than_max_positions(tiny_checkpoints, corpus_file):
    result = invoke("eval", "perplexity", tiny_checkpoints["llama-gqa"], "--text", corpus_file, "--max-length", "512")
    assert_user_error(result, "--max-length 512", "256 positions")


def test_invalid_request_values(tiny_checkpoints, corpus_file):
    model = tiny_checkpoints["llama-gqa"]
    assert_user_error(invoke("eval", "perplexity", model, "--text", corpus_file, "--max-length", "64", "--stride", "65"), "stride")
    assert_user_error(invoke("eval", "perplexity", model, "--text", corpus_file, "--max-length", "64", "--max-tokens", "10"), "max_tokens")
    assert_user_error(invoke("eval", "perplexity", model, "--text", corpus_file, "--batch-size", "0"), "--batch-size: Input should be greater than 0")
    assert_user_error(invoke("eval", "perplexity", model, "--text", corpus_file, "--dtype", "int4"), "dtype: Input should be")


def test_asset_fetch_impossible(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ERROR: network is unreachable"))
    assert_user_error(invoke("assets", "fetch", "c4-sample"), "by hand", str(tmp_path / "downloads"))
    assert_user_error(invoke("assets", "fetch", "imagenet"), "unknown asset")


def test_eval_perplexity_over_domains(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    fake_assets(tmp_path)
    a, b = tiny_checkpoints["llama-gqa"], tiny_checkpoints["qwen2"]
    args = ["eval", "perplexity", a, b, "--dataset", "wiki-sample,c4-sample,code-sample", "--max-length", "64",
            "--max-tokens", "128", "--device", "cpu"]
    table = invoke(*args)
    assert table.exit_code == 0, table.output
    assert "worst" in table.stdout and "code" in table.stdout
    record = json.loads(invoke(*args, "--json").stdout)
    assert record["texts"] == ["wiki-sample", "c4-sample", "code-sample"] and len(record["results"]) == 6
    assert record["worst"][str(b)] in record["texts"]
    assert_user_error(invoke("eval", "perplexity", a, "--dataset", "wiki-sample,cod"), "unknown dataset 'cod'", "code-sample")


def test_eval_tasks_runs_offline_and_reports_retained(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    fake_assets(tmp_path)
    a, b = tiny_checkpoints["llama-gqa"], tiny_checkpoints["qwen2"]
    result = invoke("eval", "tasks", a, b, "--tasks", "facts,cloze,passkey", "--passkey-lengths", "192,248", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    first, second = record["models"]
    assert first["results"]["facts"]["metrics"]["items"] == 10  # 5 capitals + 5 continents
    assert first["results"]["cloze"]["metrics"]["items"] == 4  # the evaluation half: 4 of 8 articles
    assert set(second["results"]["passkey"]["details"]["acc_by_length"]) == {"192", "248"}
    assert set(second["retained"]["facts"]) == {"choice_acc", "greedy_acc"}
    table = invoke("eval", "tasks", a, "--tasks", "facts", "--limit", "3", "--device", "cpu")
    assert table.exit_code == 0 and "facts 4-way" in table.stdout and "facts 3" in table.stdout


def test_eval_tasks_and_speed_refuse_bad_input_before_work(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    fake_assets(tmp_path)
    a = tiny_checkpoints["llama-gqa"]
    assert_user_error(invoke("eval", "tasks", a, "--tasks", "facts,hellaswag"), "unknown task 'hellaswag'")
    assert_user_error(invoke("eval", "tasks", a, "--tasks", "passkey", "--passkey-lengths", "512"),
                      "beyond the model's context (256 positions)")
    assert_user_error(invoke("eval", "tasks", a, tmp_path / "typo", "--tasks", "facts"), "typo")
    assert_user_error(invoke("eval", "speed", a, "--context", "1024"), "beyond", "256 positions")
    assert_user_error(invoke("eval", "speed", a, "--context", "1k"), "--context expects comma-separated integers")
    assert_user_error(invoke("eval", "tasks", a, "--tasks", "facts", "--passkey-lengths", "128"), "add it to --tasks")
    assert_user_error(invoke("eval", "tasks", a, a, "--tasks", "facts"), "named twice")
    b = tiny_checkpoints["qwen2"]  # a too-long context for the second model fails before the first is scored
    assert_user_error(invoke("eval", "perplexity", a, b, "--max-length", "512", "--dataset", "wiki-sample"), "longer than")
    (tmp_path / "text" / "wiki.utf8").write_text('<doc id="0">\nToo short.\n</doc>\n', encoding="utf-8")
    assert_user_error(invoke("eval", "tasks", a, "--tasks", "cloze"), "no cloze items")


def test_surgery_scores_the_evaluation_domains_and_fetches_them_first(tiny_checkpoints, corpus_file, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path / "cache"))
    fake_assets(tmp_path / "cache")
    out = tmp_path / "mla"
    args = ["convert", tiny_checkpoints["llama-gqa"], "--kv-budget", "0.5", "--calib-text", corpus_file, "--calib-tokens", "256",
            "--refine-steps", "0", "--eval-tokens", "128"]
    result = invoke(*args, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    domains = json.loads(result.stdout)["domains"]
    assert set(domains["scores"]) == {"wiki-sample", "c4-sample", "code-sample"}
    for figure in domains["scores"].values():
        assert figure["ratio"] == pytest.approx(figure["after"] / figure["before"])
    assert domains["worst"] == max(domains["scores"], key=lambda d: domains["scores"][d]["ratio"])
    card = (out / "README.md").read_text()
    assert "c4-sample eval part, first 128 tokens" in card and "the worst domain" in card
    table = invoke(*args, "-o", tmp_path / "mla2", "--eval-domains", "code-sample")
    assert table.exit_code == 0 and "code-sample: ppl" in table.stdout and "c4-sample" not in table.stdout
    assert_user_error(invoke(*args, "-o", tmp_path / "x", "--eval-domains", "wiki-sample,nope"), "unknown dataset 'nope'")

    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path / "empty"))  # nothing cached and no index to fetch from
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ERROR: network unreachable"))
    assert_user_error(invoke(*args, "-o", tmp_path / "offline"), "--eval-domains none")
    assert not (tmp_path / "offline").exists()
    assert invoke(*args, "-o", tmp_path / "offline", "--eval-domains", "none").exit_code == 0


def test_error_text_is_printed_as_written(tmp_path):
    """Brackets in a path are text, not console markup."""
    assert_user_error(invoke("info", tmp_path / "runs" / "exp[/old]"), "exp[/old]")
    assert_user_error(invoke("info", tmp_path / "run[bold]" / "model[v2]"), "run[bold]", "model[v2]")


@pytest.mark.parametrize("name", ["exp[/old]", "run[bold]/model[v2]"])
def test_a_model_at_a_bracketed_path_is_read_and_named_as_written(tmp_path, tiny_checkpoints, name):
    import shutil

    model = tmp_path / name
    shutil.copytree(tiny_checkpoints["llama-gqa"], model)
    result = invoke("info", model)
    assert result.exit_code == 0, result.output
    assert str(model) in result.output.replace("\n", "")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {model}\noutput: {tmp_path / 'out[/x]'}\nsteps:\n  - compress: {{method: svd, rank: 4}}\n")
    result = invoke("recipe", "validate", recipe)
    assert result.exit_code == 0 and "out[/x]" in result.output, result.output


def test_quiet_may_follow_the_command_and_flags_show_no_type():
    from attnsurg.cli import global_options_first

    assert global_options_first(["info", "m", "--quiet"]) == ["--quiet", "info", "m"]
    assert global_options_first(["-q", "info", "m"]) == ["-q", "info", "m"]
    assert global_options_first(["info", "m"]) == ["info", "m"]
    result = CliRunner().invoke(app, ["convert", "--help"], env={"COLUMNS": "120"})
    flags = [line for line in result.output.splitlines() if any(f in line for f in ("--json", "--dry-run", "--overwrite"))]
    assert result.exit_code == 0 and len(flags) >= 3 and not any("<bool>" in line for line in flags)
    assert "(default: the first half)" in result.output and "Random seed" in result.output


def test_tables_on_a_narrow_terminal_keep_every_value_whole():
    import io

    from rich.table import Table

    from attnsurg.cli.common import TableConsole

    table = Table(title="t")
    for name in ("model", "ppl", "ratio", "word ppl", "bits/byte", "tokens", "KV B/token", "params (attn)", "tok/s"):
        table.add_column(name, justify="right")
    values = ["out/smollm2-135m-mla-50", "17.2913", "1.2345", "63.247", "0.9687", "2,048", "46,080", "134.5M (26.5M)", "81"]
    table.add_row(*values)
    buffer = io.StringIO()
    TableConsole(file=buffer, width=80).print(table)
    assert all(value in buffer.getvalue() for value in values) and "…" not in buffer.getvalue()


BAD_INPUTS = {
    "windows longer than the tokens": (["convert", "{model}", "--calib-tokens", "32"], "is longer than its tokens (--calib-tokens) 32"),
    "calibration text shorter than a window": (["convert", "{model}", "--calib-text", "{short}", "--calib-seq-len", "64"],
                                               "fewer than one window of 64"),
    "missing calibration text": (["convert", "{model}", "--calib-text", "{tmp}/no.txt"], "does not exist"),
    "binary calibration text": (["compress", "{model}", "--method", "svd", "--ratio", "0.5", "--calib-text", "{binary}"], "is not UTF-8"),
    "unknown calibration dataset": (["convert", "{model}", "--calib-dataset", "wikki-sample"], "did you mean 'wiki-sample'"),
    "budget above one": (["convert", "{model}", "--kv-budget", "1.7"], "--kv-budget"),
    "unknown method": (["compress", "{model}", "--method", "magic"], "magic"),
    "second model mistyped": (["eval", "perplexity", "{model}", "{tmp}/TYPO", "--max-length", "64"], "TYPO"),
    "bracketed missing model": (["convert", "{tmp}/run[bold]/m[/x]"], "run[bold]/m[/x]"),
    "recipe writing outside": (["run", "{escaping}"], "climbs out of the working folder"),
    "binary recipe": (["run", "{binary}"], "not UTF-8 text"),
    "impossible config": (["convert", "{broken}"], "num_key_value_heads is 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_every_bad_input_is_one_line_before_any_model_loads_and_writes_nothing(case, tiny_checkpoints, tmp_path, monkeypatch):
    import attnsurg.eval.loading
    import attnsurg.pipelines.source

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(attnsurg.pipelines.source, "load_source", never)
    monkeypatch.setattr(attnsurg.pipelines.source, "load_source_model", never)
    monkeypatch.setattr(attnsurg.eval.loading, "load_model", never)
    short = tmp_path / "short.txt"
    short.write_text("A few words.")
    binary = tmp_path / "noise.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    escaping = tmp_path / "escaping.yaml"
    escaping.write_text(f"model: {tiny_checkpoints['llama-gqa']}\noutput: runs/../../out\nsteps:\n  - convert: {{}}\n")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["llama-gqa"], broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 0}))
    args, fragment = BAD_INPUTS[case]
    values = dict(model=tiny_checkpoints["llama-gqa"], tmp=tmp_path, binary=binary, escaping=escaping, broken=broken,
                  short=short)
    args = [a.format(**values) for a in args]
    if args[0] != "run" and args[:2] != ["eval", "perplexity"]:
        args += ["-o", str(tmp_path / "out")]
    before = set(tmp_path.iterdir())
    assert_user_error(invoke(*args), fragment)
    assert set(tmp_path.iterdir()) == before


def test_each_command_takes_the_other_spelling_of_its_text_options():
    from attnsurg.cli import with_aliases

    assert with_aliases(["heal", "m", "--calib-dataset", "c4-sample", "--calib-seq-len=256"]) == \
        ["heal", "m", "--dataset", "c4-sample", "--seq-len=256"]
    assert with_aliases(["convert", "m", "--text", "f.txt", "--tokens", "64"]) == \
        ["convert", "m", "--calib-text", "f.txt", "--calib-tokens", "64"]
    assert with_aliases(["analyze", "plan", "m", "--dataset", "all"])[-2] == "--calib-dataset"
    assert with_aliases(["eval", "perplexity", "m", "--dataset", "c4-sample"])[-2] == "--dataset"
    assert with_aliases(["convert", "m", "--calib-text", "--text"])[-1] == "--text"  # a file of that name


@pytest.mark.parametrize("command", [["convert"], ["compress"], ["heal"], ["run"], ["info"], ["export"], ["eval", "perplexity"],
                                     ["eval", "tasks"], ["eval", "speed"], ["analyze", "report"], ["analyze", "approx"],
                                     ["analyze", "plan"], ["recipe", "validate"], ["assets", "fetch"]])
def test_every_help_fits_80_columns_without_a_cut_value_or_a_flag_type(command):
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output and "<bool>" not in result.output, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
