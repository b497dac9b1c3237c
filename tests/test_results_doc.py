"""benchmarks/results_doc.py: docs/results.md and README's results table are what the committed runs give."""

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
spec = importlib.util.spec_from_file_location("results_doc", BENCHMARKS / "results_doc.py")
results_doc = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = results_doc
spec.loader.exec_module(results_doc)

SETTINGS = {"windows": 2, "tasks": True}


def row(name: str, kv: int, ratios: dict, kept: float) -> dict:
    worst = max(ratios, key=ratios.get)
    return {"name": name, "kv_bytes_per_token": kv, "ratios": ratios, "worst": worst, "ppl": {d: 10.0 for d in ratios},
            "facts": [0.7, 0.4], "facts_kept": [kept, kept], "cloze_acc": 0.4, "passkey": {"512": 1.0, "1024": 0.8}}


def run(model: str, *rows: dict) -> dict:
    return {"model": model, "settings": SETTINGS, "rows": list(rows),
            "provenance": {"commit": "0123456789abcdef", "date": "2026-12-03T00:00:00+00:00",
                           "versions": {"torch": "2.13.0", "transformers": "5.0"},
                           "machine": {"cores": 2, "torch_threads": 2, "device": "cpu"}}}


def test_the_summary_gives_kv_worst_and_facts_per_model_and_says_what_was_not_run():
    original = row("original", 1000, {"wiki-sample": 1.0, "c4-sample": 1.0}, 1.0)
    demo = run("smollm2-135m", original, row("mla-50", 500, {"wiki-sample": 1.3, "c4-sample": 1.5}, 0.82))
    other = run("qwen", original, {"name": "mla-50", "refused": "sliding window"}, row("tucker-50", 800, {"wiki-sample": 2.0, "c4-sample": 1.1}, 0.5))
    table = results_doc.summary_table([demo, other])
    lines = table.splitlines()
    assert lines[2] == "| mla-50 | x0.50 · x1.50 c4 · 0.82 | refused |"
    assert lines[3] == "| tucker-50 | not run | x0.80 · x2.00 wiki · 0.50 |"


def test_a_share_kept_is_not_shown_where_the_original_barely_answers():
    original = {**row("original", 1000, {"wiki-sample": 1.0}, 1.0), "facts": [0.55, 0.003]}
    converted = {**row("mla-50", 500, {"wiki-sample": 1.2}, 0.9), "facts": [0.5, 0.0], "facts_kept": [0.9, 0.0]}
    table = results_doc.matrix_table([original, converted], SETTINGS)
    assert "| 0.500 (0.900) | 0.000 (n/a) |" in table.splitlines()[-1]


def test_the_results_page_has_each_model_its_command_and_provenance():
    original = row("original", 1000, {"wiki-sample": 1.0, "c4-sample": 1.0}, 1.0)
    page = results_doc.results_doc([run("qwen2.5-coder-0.5b", original, row("mla-50", 500, {"wiki-sample": 1.3, "c4-sample": 1.5}, 0.8))])
    assert "## qwen2.5-coder-0.5b" in page and "quality_matrix.py --model qwen2.5-coder-0.5b" in page
    assert "commit `0123456789`" in page and "| mla-50 | 500 | x1.300 | x1.500 | x1.500 c4 |" in page


def test_a_recipe_rerun_alone_keeps_the_other_rows_with_the_run_that_made_them(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    matrix_spec = importlib.util.spec_from_file_location("quality_matrix", BENCHMARKS / "quality_matrix.py")
    quality_matrix = importlib.util.module_from_spec(matrix_spec)
    matrix_spec.loader.exec_module(quality_matrix)
    original = row("original", 1000, {"wiki-sample": 1.0, "c4-sample": 1.0}, 1.0)
    published = run("smollm2-135m", original, row("mla-50", 500, {"wiki-sample": 1.3, "c4-sample": 1.5}, 0.8),
                    row("tucker-50", 800, {"wiki-sample": 2.0, "c4-sample": 1.1}, 0.5))
    fresh = [original, row("mla-50", 500, {"wiki-sample": 1.2, "c4-sample": 1.4}, 0.9)]
    rows = quality_matrix.updated_rows(published, fresh)
    assert [r["name"] for r in rows] == ["original", "mla-50", "tucker-50"]
    assert rows[1] is fresh[1] and "provenance" not in rows[0] and rows[2]["provenance"] == published["provenance"]
    newer = {**published, "rows": rows, "provenance": {**published["provenance"], "commit": "fedcba9876543210"}}
    page = results_doc.results_doc([newer])
    assert "commit `fedcba9876`" in page and "Rows tucker-50: Run at commit `0123456789`" in page
    path = tmp_path / "published.json"
    path.write_text(json.dumps(published))
    assert quality_matrix.published_matrix(path, SETTINGS, "smollm2-135m") == published
    for settings, model in (({**SETTINGS, "windows": 4}, "smollm2-135m"), (SETTINGS, "qwen")):
        try:
            quality_matrix.published_matrix(path, settings, model)
        except SystemExit as refusal:
            assert "another model or settings" in str(refusal)
        else:
            raise AssertionError("a matrix of another model or settings was merged")


def test_the_committed_docs_match_the_committed_runs():
    runs, long_runs = results_doc.load_runs(), results_doc.load_runs(kind="long_context")
    assert runs, "docs/results/ holds no quality_matrix*.json"
    assert results_doc.DOC.read_text() == results_doc.results_doc(runs, long_runs)
    assert results_doc.README.read_text() == results_doc.with_summary(results_doc.README.read_text(), runs, long_runs)


def long_row(name: str, rates: list[float], kept: list[float], late: float) -> dict:
    lengths = ["2048", "8192"]
    return {"name": name, "retrieval": dict(zip(lengths, rates)), "retrieval_stderr": {n: 0.05 for n in lengths},
            "retrieval_kept": dict(zip(lengths, kept)), "ppl_ratio_by_position": {"0-4K": 1.1, "4K-8K": late}}


def long_run(model: str, *rows: dict) -> dict:
    return {**run(model, *rows), "context": 8192,
            "settings": {"lengths": [2048, 8192], "questions": 80, "ppl_length": 8192, "ppl_windows": 2,
                         "ppl_text": "wiki-sample"}}


def test_long_context_rows_go_under_their_model_and_into_the_summary():
    original = row("original", 1000, {"wiki-sample": 1.0, "c4-sample": 1.0}, 1.0)
    matrix = run("smollm2-135m", original, row("mla-50", 500, {"wiki-sample": 1.3, "c4-sample": 1.5}, 0.82),
                 row("tucker-50", 800, {"wiki-sample": 2.0, "c4-sample": 1.1}, 0.5))
    long = long_run("smollm2-135m", long_row("original", [0.5, 0.4], [1.0, 1.0], 1.0),
                    long_row("mla-50", [0.3, 0.0], [0.5, 0.0], 1.9))
    page = results_doc.results_doc([matrix], [long])
    assert "### Long context" in page and "python benchmarks/long_context.py`" in page
    assert "| mla-50 | 0.30 ± 0.05 (0.50) | 0.00 ± 0.05 (0.00) | x1.100 | x1.900 |" in page
    lines = results_doc.summary_table([matrix], [long]).splitlines()
    assert lines[0].endswith("facts kept · retrieval kept at 8K |")
    assert lines[2] == "| mla-50 | x0.50 · x1.50 c4 · 0.82 · 0.00 |"
    assert lines[3] == "| tucker-50 | x0.80 · x2.00 wiki · 0.50 · - |"  # no long-context run of it yet
    assert "Long context" not in results_doc.results_doc([matrix])  # a model without a run gets no section
