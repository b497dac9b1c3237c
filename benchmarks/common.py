"""What the compression benchmarks share: the demo model, its evaluation windows and one calibration."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import attention_layers, calibration_windows, input_statistics
from attnsurg.eval.perplexity import eval_windows, perplexity_of
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.requests import TextData


@dataclass
class Setup:
    model: object
    tokenizer: object
    anatomy: object
    family: object
    tokens: object
    eval_plan: object
    original_ppl: float
    stats: list  # per layer: (attention input, o_proj input) statistics
    seq_len: int
    calibration_s: float

    def ppl(self, model) -> float:
        return perplexity_of(model, self.tokens, self.eval_plan)


def prepare(model_ref: str, windows: int, calib_tokens: int, seq_len: int = 512) -> Setup:
    """Load, score the original on WINDOWS x 1024 eval tokens of wiki-sample, calibrate once on its
    calibration half (attention and o_proj inputs of every layer)."""
    source = resolve_source(model_ref)
    model, tokenizer = load_model(source), load_tokenizer(source)
    anatomy = inspect_config(model.config)
    family = family_for_surgery(anatomy.model_type)
    tokens, plan = eval_windows(tokenizer, TextData(dataset="wiki-sample", part="eval"), 1024, windows * 1024)
    original = perplexity_of(model, tokens, plan)
    start = time.perf_counter()
    calib = calibration_windows(tokenizer, TextData(dataset="wiki-sample", part="calib"), calib_tokens, seq_len)
    attns = attention_layers(model, family)
    flat = input_statistics(model, attns + [a.o_proj for a in attns], calib)
    stats = list(zip(flat[: len(attns)], flat[len(attns) :]))
    return Setup(model, tokenizer, anatomy, family, tokens, plan, original, stats, calib.shape[1], time.perf_counter() - start)


@torch.inference_mode()
def cache_bytes_per_token(model, context: int = 256) -> float:
    """Bytes per token (as bf16) the transformers cache holds after a forward over ``context`` tokens."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.zeros(1, context, dtype=torch.long), cache=cache, use_cache=True)
    total = sum(t.numel() * 2 for layer in cache.layers for t in (layer.keys, layer.values))
    return total / context


HERE = Path(__file__).parent
RESULTS = HERE / "results"


def provenance() -> dict:
    """Where a result comes from: the commit (and whether the tree had uncommitted changes), the library
    versions, the machine (cores, torch threads, device) and the time, so a figure in the docs traces to a run."""
    import importlib.metadata
    import os
    import platform
    import subprocess

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE)
        except FileNotFoundError:  # no git on this machine
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    versions = {}
    for package in ("attnsurg", "torch", "transformers", "accelerate", "tensorly", "safetensors"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), **versions},
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"},
    }


_STARTED: dict | None = None


def record_start() -> None:
    """Take the provenance now, before the run, so later edits to the tree do not show in this run's record."""
    global _STARTED
    _STARTED = provenance()


def cached_by_settings(cache: Path, settings: dict, compute) -> dict:
    """``compute()``'s record (which holds ``settings``), read from ``cache`` when it was made with the same
    settings, else computed and written there: a benchmark's slow per-model scores reused by later runs."""
    if cache.is_file():
        cached = json.loads(cache.read_text())
        if cached["settings"] == settings:
            return cached
    record = compute()
    cache.write_text(json.dumps(record))
    return record


def write_result(name: str, record, **dumps) -> Path:
    """Write a benchmark's record to benchmarks/results/NAME.json, with its ``provenance`` (as taken by
    ``record_start`` when the benchmark called it, else now) and the time it finished."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    finished = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    origin = {**(_STARTED or provenance()), "finished": finished}
    record = {"provenance": origin, **record} if isinstance(record, dict) else {"provenance": origin, "result": record}
    path.write_text(json.dumps(record, indent=2, **dumps))
    return path


record_start()  # a benchmark's provenance is the tree it was started from
