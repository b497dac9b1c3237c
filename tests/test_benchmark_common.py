"""benchmarks/common.py: every result a benchmark writes says where it comes from."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("benchmark_common", Path(__file__).parent.parent / "benchmarks" / "common.py")
common = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = common  # its dataclasses look their module up
spec.loader.exec_module(common)


def test_a_result_carries_the_commit_versions_machine_and_date(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    path = common.write_result("check", {"ratio": 1.5})
    record = json.loads(path.read_text())
    assert path == tmp_path / "results" / "check.json" and record["ratio"] == 1.5
    origin = record["provenance"]
    assert origin["commit"] == common.provenance()["commit"]  # git's HEAD, or None outside a git checkout
    if origin["commit"] is not None:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
        assert origin["commit"] == head.stdout.strip()
    assert {"python", "attnsurg", "torch", "transformers"} <= set(origin["versions"])
    assert origin["machine"]["cores"] >= 1 and origin["machine"]["torch_threads"] >= 1 and origin["machine"]["device"]
    assert origin["date"].startswith("20")


def test_provenance_taken_at_the_start_is_the_one_written(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "provenance", lambda: {"commit": "at-start", "date": "2026-01-01T00:00:00+00:00"})
    common.record_start()
    monkeypatch.setattr(common, "provenance", lambda: {"commit": "later", "date": "2026-01-02T00:00:00+00:00"})
    origin = json.loads(common.write_result("check", [1, 2]).read_text())["provenance"]
    monkeypatch.setattr(common, "_STARTED", None)
    assert origin["commit"] == "at-start" and origin["finished"] >= origin["date"]
