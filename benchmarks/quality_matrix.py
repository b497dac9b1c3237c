"""Every shipped recipe on the demo model, scored where users live: six text domains, facts, cloze, passkey.

    python benchmarks/quality_matrix.py [RECIPE ...] [--model smollm2-135m] [--out-dir out/quality] [--windows 2]
                                        [--limit N] [--passkey-lengths 512,1024,2048,4096] [--no-tasks]

Runs each recipe (all shipped ones by default) with `attnsurg run RECIPE -o OUT_DIR/RECIPE` unless that
checkpoint is already there, then scores the original and every result on the same windows (the first
WINDOWS x 1024 tokens of each domain's evaluation part) and the same task items. ``--model`` runs the recipes
on another model (e.g. the opt-in gemma3-270m; default OUT_DIR out/quality-MODEL); a recipe whose method
refuses that model gets a row saying why. A model's scores are kept
in OUT_DIR/NAME.scores.json and reused by later runs with the same settings, so the slow recipes can be added
in a second run. Prints one markdown table (perplexity ratios to the original; facts as the share of the
original's right answers kept; cloze accuracy; passkey retrieval) and writes results/quality_matrix.json,
which `benchmarks/results_doc.py` turns into docs/results.md once copied into docs/results/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from attnsurg.arch import inspect_config
from attnsurg.data import DOMAINS
from attnsurg.methods import registered_methods
from attnsurg.eval.perplexity import run_perplexity
from attnsurg.eval.tasks import run_tasks
from attnsurg.eval.tasks.base import retained
from attnsurg.eval.tasks.cloze import load_cloze_items
from attnsurg.eval.tasks.facts import load_fact_items
from attnsurg.io.load import load_config, resolve_source
from attnsurg.io.recipe_file import load_recipe, shipped_recipes
from attnsurg.recipe import ConvertSettings
from attnsurg.requests import ModelRef, PerplexityEval, TasksEval, TextData
from common import cached_by_settings, write_result
from results_doc import matrix_note, matrix_table
from attnsurg.pipelines.run import run_recipe

DEMO = "smollm2-135m"


def refusal(name: str, model: str) -> str | None:
    """Why the recipe's method cannot run on ``model`` (the registry's reason), or None."""
    settings = load_recipe(Path(name)).surgery
    method = settings.to if isinstance(settings, ConvertSettings) else settings.method
    return registered_methods()[method].unsupported_reason(inspect_config(load_config(resolve_source(model))))


def checkpoint_for(name: str, out_dir: Path, model: str) -> tuple[Path, float | None]:
    """The recipe's checkpoint on ``model`` (run now unless already written) and the seconds the run took."""
    output = out_dir / name
    if (output / "config.json").is_file():
        return output, None
    recipe = load_recipe(Path(name))
    recipe = recipe.model_copy(update={"output": output, "model": recipe.model.model_copy(update={"ref": model})})
    start = time.perf_counter()
    run_recipe(recipe)
    return output, time.perf_counter() - start


def item_fingerprint() -> str:
    """Changes whenever the facts or cloze items change, so cached scores are not reused across them."""
    texts = [i.context + i.choices[i.answer] for i in load_fact_items()] + [i.context + i.target for i in load_cloze_items(300)]
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:12]


def scores_of(model: str, settings: dict, cache: Path) -> dict:
    """Perplexity on every domain and the task results of one model, cached by settings."""
    return cached_by_settings(cache, settings, lambda: scored(model, settings))


def scored(model: str, settings: dict) -> dict:
    texts = [TextData(dataset=name) for name in DOMAINS]
    ppl = run_perplexity(PerplexityEval(models=[ModelRef(ref=model)], data=texts[0], more_data=texts[1:],
                                        max_tokens=settings["windows"] * 1024, device="cpu"))
    record = {"settings": settings, "ppl": {r.text: r.ppl for r in ppl.results},
              "kv_bytes_per_token": ppl.results[0].kv_bytes_per_token, "tasks": None}
    if settings["tasks"]:
        report = run_tasks(TasksEval(models=[ModelRef(ref=model)], limit=settings["limit"],
                                     passkey_lengths=settings["passkey_lengths"], device="cpu"))
        record["tasks"] = {task: {"metrics": r.metrics, "items": r.items, "details": r.details}
                           for task, r in report.models[0].results.items()}
    return record


def row_of(name: str, record: dict, original: dict) -> dict:
    ratios = {d: record["ppl"][d] / original["ppl"][d] for d in DOMAINS}
    worst = max(ratios, key=ratios.get)
    row = {"name": name, "kv_bytes_per_token": record["kv_bytes_per_token"], "ratios": ratios, "worst": worst}
    tasks, first = record["tasks"], original["tasks"]
    if tasks:
        row["facts_kept"] = [retained(first["facts"]["items"][m], tasks["facts"]["items"][m]) for m in ("choice_acc", "greedy_acc")]
        row["facts"] = [tasks["facts"]["metrics"][m] for m in ("choice_acc", "greedy_acc")]
        row["cloze_acc"] = tasks["cloze"]["metrics"]["acc"]
        row["passkey"] = tasks["passkey"]["details"]["acc_by_length"]
    return row


def published_matrix(path: Path, settings: dict, model: str) -> dict:
    """The matrix ``--update`` merges into, refused before any run when it was scored otherwise."""
    published = json.loads(path.read_text())
    if published["settings"] != settings or published["model"] != model:
        raise SystemExit("--update: the published matrix is of another model or settings; run every recipe instead")
    return published


def updated_rows(published: dict, rows: list[dict]) -> list[dict]:
    """The rows run now, then ``published``'s rows of every other recipe, in its order, each carrying the
    provenance of its own run."""
    fresh = {row["name"]: row for row in rows}
    kept = [row if row["name"] in fresh else {**row, "provenance": row.get("provenance", published["provenance"])}
            for row in published["rows"]]
    merged = [fresh.pop(row["name"]) if row["name"] in fresh else row for row in kept]
    return merged + list(fresh.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="shipped recipe names (default: all)")
    parser.add_argument("--model", default=DEMO, help="the model every recipe runs on")
    parser.add_argument("--out-dir", type=Path, default=None, help="default out/quality (the demo), out/quality-MODEL")
    parser.add_argument("--windows", type=int, default=2, help="1024-token windows per domain")
    parser.add_argument("--limit", type=int, default=None, help="at most N facts and cloze items")
    parser.add_argument("--passkey-lengths", default="512,1024,2048,4096")
    parser.add_argument("--no-tasks", action="store_true")
    parser.add_argument("--update", type=Path, default=None, help="a published matrix whose other rows to keep")
    args = parser.parse_args()

    names = args.recipes or [p.stem for p in shipped_recipes()]
    label = Path(args.model).name  # an asset name, or a checkpoint folder's name
    out_dir = args.out_dir or Path("out/quality" if args.model == DEMO else f"out/quality-{label}")
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"windows": args.windows, "limit": args.limit, "tasks": not args.no_tasks,
                "passkey_lengths": [int(n) for n in args.passkey_lengths.split(",")], "items": item_fingerprint()}
    published = published_matrix(args.update, settings, args.model) if args.update else None
    original = scores_of(args.model, settings, out_dir / f"{label}.scores.json")
    rows = [{**row_of("original", original, original), "ppl": original["ppl"]}]
    run_seconds = {}
    for name in names:
        if reason := refusal(name, args.model):
            rows.append({"name": name, "refused": reason})
            continue
        checkpoint, seconds = checkpoint_for(name, out_dir, args.model)
        run_seconds[name] = seconds
        anatomy = inspect_config(load_config(resolve_source(str(checkpoint))))
        record = scores_of(str(checkpoint), settings, out_dir / f"{name}.scores.json")
        rows.append({**row_of(name, record, original), "model_type": anatomy.model_type})
    if published:
        rows = updated_rows(published, rows)
    print(matrix_table(rows, settings) + "\n\n" + matrix_note(rows, settings))
    suffix = "" if args.model == DEMO else f"-{label}"
    write_result(f"quality_matrix{suffix}", {"model": args.model, "settings": settings, "rows": rows,
                                            "run_seconds": run_seconds})


if __name__ == "__main__":
    main()
