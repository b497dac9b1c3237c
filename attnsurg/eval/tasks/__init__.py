"""``attnsurg eval tasks``: zero-shot downstream tasks (facts, cloze, passkey, and any lm-evaluation-harness
task through the optional harness), every model on the same items, one model in memory at a time, with
"retained" figures against the first model."""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from typing import Any

from attnsurg.errors import UserError
from attnsurg.eval.loading import Loaded, check_models_exist, load_weights, prepare_for_eval
from attnsurg.eval.tasks.base import TaskResult, retained
from attnsurg.eval.tasks.cloze import load_cloze_items, score_cloze
from attnsurg.eval.tasks.facts import load_fact_items, score_facts
from attnsurg.eval.tasks.harness import check_harness_tasks, run_harness
from attnsurg.eval.tasks.passkey import check_lengths, default_lengths, passkey_items, score_passkey
from attnsurg.recipe import TasksEval


@dataclass
class ModelTasks:
    model: str
    model_type: str
    dtype: str
    device: str
    results: dict[str, TaskResult] = field(default_factory=dict)
    retained: dict[str, dict[str, float]] = field(default_factory=dict)
    harness: dict[str, dict] = field(default_factory=dict)  # lm-evaluation-harness: metrics and samples per task
    harness_retained: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class TasksReport:
    tasks: list[str]
    lm_eval: list[str] = field(default_factory=list)
    models: list[ModelTasks] = field(default_factory=list)

    def to_dict(self, with_items: bool = False) -> dict[str, Any]:
        record = asdict(self)
        if not with_items:
            for model in record["models"]:
                for result in model["results"].values():
                    result.pop("items")
                for result in model["harness"].values():
                    result.pop("samples")
        return record


def passkey_lengths(request: TasksEval, loaded: Loaded) -> list[int]:
    limit = loaded.max_positions or 2048
    lengths = request.passkey_lengths or default_lengths(limit)
    check_lengths(lengths, limit)
    return lengths


def score_model(request: TasksEval, loaded: Loaded) -> ModelTasks:
    record = ModelTasks(loaded.ref.ref, loaded.anatomy.model_type, loaded.dtype_name, str(loaded.device))
    model, tokenizer = loaded.model, loaded.tokenizer
    max_length = min(request.max_length, loaded.max_positions or request.max_length)
    for task in request.tasks:
        if task == "facts":
            items = load_fact_items()[: request.limit]
            record.results[task] = score_facts(model, tokenizer, items, max_length)
        elif task == "cloze":
            items = load_cloze_items(min(request.cloze_items, request.limit or request.cloze_items))
            record.results[task] = score_cloze(model, tokenizer, items, max_length)
        else:
            record.results[task] = score_passkey(model, tokenizer, passkey_items(tokenizer, passkey_lengths(request, loaded)))
    return record


def add_retained(report: TasksReport) -> None:
    reference = report.models[0]
    for other in report.models:
        for task, result in other.results.items():
            first = reference.results[task].items
            other.retained[task] = {metric: retained(first[metric], credits) for metric, credits in result.items.items()
                                    if len(first.get(metric, [])) == len(credits)}
        for task, result in other.harness.items():
            first, mine = sample_credits(reference.harness[task]["samples"]), sample_credits(result["samples"])
            other.harness_retained[task] = {metric: retained(first[metric], credits) for metric, credits in mine.items()
                                            if len(first.get(metric, [])) == len(credits)}


def sample_credits(samples: list[dict]) -> dict[str, list[float]]:
    """lm-eval's per-document 0/1 metrics (acc, acc_norm, exact_match...), in document order."""
    ordered = sorted(samples, key=lambda sample: sample["doc_id"])
    metrics = {key for sample in ordered for key, value in sample.items() if key != "doc_id" and value in (0, 1, 0.0, 1.0)}
    return {metric: [float(sample.get(metric, 0.0)) for sample in ordered] for metric in sorted(metrics)}


def run_tasks(request: TasksEval) -> TasksReport:
    """Score every model of the request on the same task items."""
    check_models_exist(request.models)
    manager = check_harness_tasks(request.lm_eval, request.lm_eval_include) if request.lm_eval else None
    report = TasksReport(tasks=list(request.tasks), lm_eval=list(request.lm_eval))
    for ref in request.models:
        loaded = prepare_for_eval(ref, request.device, request.dtype)
        if "passkey" in request.tasks:
            passkey_lengths(request, loaded)  # a length beyond the context fails before the weights load
        load_weights(loaded)
        record = score_model(request, loaded)
        if manager is not None:
            record.harness = run_harness(loaded.model, loaded.tokenizer, request.lm_eval, manager, request.limit)
        report.models.append(record)
        del loaded
        gc.collect()
    add_retained(report)
    return report


def parse_tasks(value: str) -> list[str]:
    from attnsurg.recipe import TASK_NAMES

    if value.strip().lower() == "none":
        return []
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASK_NAMES]
    if unknown or not names:
        raise UserError(f"unknown task '{unknown[0] if unknown else value}'; choose from {', '.join(TASK_NAMES)} "
                        "(or none), and run lm-evaluation-harness tasks with --lm-eval")
    return names
