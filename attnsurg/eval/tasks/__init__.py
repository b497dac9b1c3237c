"""``attnsurg eval tasks``: zero-shot downstream tasks (facts, cloze, passkey, retrieval, and any lm-evaluation-harness
task through the optional harness), every model on the same items, one model in memory at a time, with
"retained" figures against the first model."""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from typing import Any

from attnsurg.errors import UserError
from attnsurg.eval.loading import Loaded, check_models, load_weights, prepare_for_eval
from attnsurg.eval.tasks.base import TaskResult, retained
from attnsurg.eval.tasks.cloze import load_cloze_items, score_cloze
from attnsurg.eval.tasks.facts import load_fact_items, score_facts
from attnsurg.eval.tasks.harness import check_harness_tasks, run_harness
from attnsurg.eval.tasks import retrieval
from attnsurg.eval.tasks.scoring import grouped_queries_in_sdpa
from attnsurg.eval.tasks.passkey import check_lengths, default_lengths, passkey_items, score_passkey
from attnsurg.requests import TasksEval


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


def passkey_lengths(request: TasksEval, config) -> list[int]:
    limit = getattr(config, "max_position_embeddings", None) or 2048
    lengths = request.passkey_lengths or default_lengths(limit)
    check_lengths(lengths, limit)
    return lengths


def retrieval_lengths(request: TasksEval, config) -> list[int]:
    limit = getattr(config, "max_position_embeddings", None) or 2048
    lengths = request.retrieval_lengths or retrieval.default_lengths(limit)
    retrieval.check_lengths(lengths, limit)
    return lengths


def check_lengths_of(request: TasksEval, config) -> None:
    """The lengths the long-context tasks asked for fit the model's context (before any weights load)."""
    if "passkey" in request.tasks:
        passkey_lengths(request, config)
    if "retrieval" in request.tasks:
        retrieval_lengths(request, config)


def shared_items(request: TasksEval) -> dict[str, list]:
    """The facts and cloze items every model is scored on, built once before any model loads."""
    items: dict[str, list] = {}
    if "facts" in request.tasks:
        items["facts"] = load_fact_items()[: request.limit]
    if "cloze" in request.tasks:
        items["cloze"] = load_cloze_items(min(request.cloze_items, request.limit or request.cloze_items))
    return items


def score_model(request: TasksEval, loaded: Loaded, items: dict[str, list]) -> ModelTasks:
    record = ModelTasks(loaded.ref.ref, loaded.anatomy.model_type, loaded.dtype_name, str(loaded.device))
    model, tokenizer = loaded.model, loaded.tokenizer
    max_length = min(request.max_length, loaded.max_positions or request.max_length)
    for task in request.tasks:
        if task == "facts":
            record.results[task] = score_facts(model, tokenizer, items["facts"], max_length)
        elif task == "cloze":
            record.results[task] = score_cloze(model, tokenizer, items["cloze"], max_length)
        elif task == "passkey":
            lengths = passkey_lengths(request, loaded.config)
            record.results[task] = score_passkey(model, tokenizer, passkey_items(tokenizer, lengths))
        else:
            haystacks = retrieval.retrieval_items(tokenizer, retrieval_lengths(request, loaded.config),
                                                  request.retrieval_variants, request.retrieval_questions)
            record.results[task] = retrieval.score_retrieval(model, tokenizer, haystacks)
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
    """lm-eval's per-document right/wrong metrics (acc, acc_norm, exact_match...: every value 0 or 1), in
    document order; graded metrics (f1, bleu) have no "right answer" to keep."""
    ordered = sorted(samples, key=lambda sample: sample["doc_id"])
    names = {key for sample in ordered for key in sample if key != "doc_id"}
    binary = [name for name in sorted(names) if all(sample.get(name) in (0, 1) for sample in ordered)]
    return {name: [float(sample[name]) for sample in ordered] for name in binary}


def run_tasks(request: TasksEval) -> TasksReport:
    """Score every model of the request on the same task items."""
    check_models(request.models, lambda ref, config: check_lengths_of(request, config))
    manager = check_harness_tasks(request.lm_eval, request.lm_eval_include) if request.lm_eval else None
    items = shared_items(request)
    report = TasksReport(tasks=list(request.tasks), lm_eval=list(request.lm_eval))
    for ref in request.models:
        loaded = prepare_for_eval(ref, request.device, request.dtype)
        load_weights(loaded)
        with grouped_queries_in_sdpa(loaded.device):
            record = score_model(request, loaded, items)
        if manager is not None:
            record.harness = run_harness(loaded.model, loaded.tokenizer, request.lm_eval, manager, request.limit)
        report.models.append(record)
        del loaded
        gc.collect()
    add_retained(report)
    return report


def parse_tasks(value: str) -> list[str]:
    from attnsurg.requests import TASK_NAMES

    if value.strip().lower() == "none":
        return []
    names = list(dict.fromkeys(name.strip() for name in value.split(",") if name.strip()))
    unknown = [name for name in names if name not in TASK_NAMES]
    if unknown or not names:
        raise UserError(f"unknown task '{unknown[0] if unknown else value}'; choose from {', '.join(TASK_NAMES)} "
                        "(or none), and run lm-evaluation-harness tasks with --lm-eval")
    return names
