"""``--lm-eval TASKS``: hand the loaded model to lm-evaluation-harness (the optional extra
``attnsurg[lm-eval]``), so hellaswag, arc_easy, piqa, winogrande or mmlu run exactly as the papers run them.

The model object attnsurg loaded (any checkpoint it reads, attnsurg's own included) goes in as
``HFLM(pretrained=model)``; ``include`` adds a folder of local task YAML files (for data on disk, offline).
"""

from __future__ import annotations

from pathlib import Path

from attnsurg.errors import UserError

BATCH_SIZE = 1  # no padding reaches the model (exact for every attnsurg attention)


def harness():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("--lm-eval needs lm-evaluation-harness: pip install 'attnsurg[lm-eval]'") from None
    return lm_eval, HFLM, TaskManager


def check_harness_tasks(tasks: list[str], include: Path | None):
    """The task manager, once every task name is known to it (before any model is loaded)."""
    _, _, TaskManager = harness()
    if include is not None and not Path(include).is_dir():
        raise UserError(f"--lm-eval-include '{include}' is not a folder of task YAML files")
    manager = TaskManager(include_path=str(include) if include else None)
    known = set(manager.all_tasks)
    unknown = [task for task in tasks if task not in known]
    if unknown:
        raise UserError(f"lm-evaluation-harness has no task '{unknown[0]}'; list them with `lm-eval ls tasks`, or "
                        "add a folder of task YAML files with --lm-eval-include")
    try:  # the tasks' data, fetched now rather than after a model has loaded
        if hasattr(manager, "load"):
            manager.load(tasks)
        else:  # lm-eval before 0.4.10
            from lm_eval.tasks import get_task_dict

            get_task_dict(tasks, manager)
    except Exception as exc:  # the harness raises hub, datasets and YAML errors alike
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"lm-evaluation-harness could not load the data of {', '.join(tasks)} ({first}); it needs a "
                        "network or its cache, or local task files (--lm-eval-include)") from None
    return manager


def run_harness(model, tokenizer, tasks: list[str], manager, limit: int | None) -> dict[str, dict]:
    """Each task's numeric metrics and, per document, the sample records lm-eval logs."""
    lm_eval, HFLM, _ = harness()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=BATCH_SIZE, device=str(model.device))
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=True)
    scored = {}
    for task, metrics in results["results"].items():
        scored[task] = {
            "metrics": {name: value for name, value in metrics.items() if isinstance(value, (int, float))},
            "samples": [{key: sample[key] for key in ("doc_id", *sample.get("metrics", [])) if key in sample}
                        for sample in results.get("samples", {}).get(task, [])],
        }
    return scored
