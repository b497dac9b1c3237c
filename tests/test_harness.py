"""lm-evaluation-harness through ``eval tasks --lm-eval``, offline: a local task file over a small JSON dataset."""

import json

import pytest
from typer.testing import CliRunner

from attnsurg.cli import app
from attnsurg.eval.tasks.base import ChoiceItem, multiple_choice
from attnsurg.io.load import load_model, load_tokenizer, resolve_source

pytest.importorskip("lm_eval", reason="the optional extra attnsurg[lm-eval] is not installed")

ROWS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " Berlin", " Madrid"], "answer": 0},
    {"question": "The grass is", "choices": [" green", " blue", " red", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" three", " four", " five", " ten"], "answer": 1},
    {"question": "The cat sat on the", "choices": [" mat", " sky", " idea", " river"], "answer": 0},
    {"question": "Water boils at one hundred", "choices": [" degrees", " miles", " songs", " apples"], "answer": 0},
]
TASK = """task: attnsurg_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture
def task_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    folder = tmp_path / "tasks"
    folder.mkdir()
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in ROWS), encoding="utf-8")
    (folder / "tiny_choice.yaml").write_text(TASK.format(data=data), encoding="utf-8")
    return folder


def test_harness_scores_agree_with_attnsurgs_own_choice_scoring(tiny_checkpoints, task_dir):
    a, b = tiny_checkpoints["llama-gqa"], tiny_checkpoints["qwen2"]
    result = CliRunner().invoke(app, ["eval", "tasks", str(a), str(b), "--tasks", "none", "--lm-eval", "attnsurg_tiny_choice",
                                      "--lm-eval-include", str(task_dir), "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    first, second = record["models"]
    assert set(second["harness_retained"]["attnsurg_tiny_choice"]) == {"acc"}
    items = [ChoiceItem(str(i), row["question"], tuple(row["choices"]), row["answer"]) for i, row in enumerate(ROWS)]
    for model, path in zip(record["models"], (a, b)):
        source = resolve_source(str(path))
        ours, _ = multiple_choice(load_model(source), load_tokenizer(source), items, max_length=256)
        assert model["harness"]["attnsurg_tiny_choice"]["metrics"]["acc,none"] == pytest.approx(sum(ours) / len(ours))


def test_unknown_harness_task_is_refused_before_loading(tiny_checkpoints, task_dir):
    result = CliRunner().invoke(app, ["eval", "tasks", str(tiny_checkpoints["llama-gqa"]), "--tasks", "none",
                                      "--lm-eval", "no_such_task", "--lm-eval-include", str(task_dir)])
    assert result.exit_code == 2 and "no task 'no_such_task'" in result.stderr and "Loading" not in result.stderr


def test_missing_task_data_is_one_clear_line_before_loading(tiny_checkpoints, task_dir, tmp_path):
    (task_dir / "tiny_choice.yaml").write_text(TASK.format(data=tmp_path / "missing.jsonl"), encoding="utf-8")
    result = CliRunner().invoke(app, ["eval", "tasks", str(tiny_checkpoints["llama-gqa"]), "--tasks", "none",
                                      "--lm-eval", "attnsurg_tiny_choice", "--lm-eval-include", str(task_dir)])
    assert result.exit_code == 2 and "could not load the data" in result.stderr and "Loading" not in result.stderr
