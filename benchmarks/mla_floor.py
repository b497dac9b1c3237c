"""Where an MLA conversion's loss comes from: the shared RoPE key alone, the latent alone, and both.

    python benchmarks/mla_floor.py [--model smollm2-135m] [--budgets 0.5 0.25] [--out-dir out/mla-floor] [--facts]
                                   [-- EXTRA CONVERT OPTIONS]

For each KV budget, three conversions of the same model, each with the convert defaults otherwise (six-domain
calibration, refinement), scored on all six domains against the original in the same run:
- ``rope only``: the RoPE dims and fold the budget's default plan picks, the latent kept at full rank (nothing
  compressed; more values cached than the original). What the DeepseekV3 layout itself costs: one RoPE key
  shared by every head, so a GQA model's other key components per frequency lose their rotation.
- ``mla``: the default conversion at that budget.
- ``latent only``: SVD-LLM's shared k/v latent at the same budget (``compress --method svdllm --targets k,v
  --kv-latent --allocate``): keys rebuilt before RoPE, so no RoPE constraint, no refinement. What compressing the
  cache to that size costs without the layout.
``--facts`` adds the share of the original's right facts answers each keeps (4-way / greedy). Runs the CLI
(``--json``) so each row's command is the one a user types; a row already written under OUT_DIR by the same
command is reused.
Writes results/mla_floor.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from attnsurg.arch import inspect_config
from attnsurg.data import DOMAINS
from attnsurg.eval.tasks import run_tasks
from attnsurg.io.load import load_config, resolve_source
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.requests import ModelRef, TasksEval
from common import write_result


def commands(model: str, budget: float, extra: list[str]) -> dict[str, list[str]]:
    """The three conversions of one budget, as attnsurg command lines (without -o/--json)."""
    plan = plan_mla(inspect_config(load_config(resolve_source(model))), kv_budget=budget)
    domains = ["--eval-domains", "all"]
    return {
        "rope only": ["convert", model, "--to", "mla", "--kv-rank", str(plan.full_rank), "--rope-dim", str(plan.rope_dim),
                      "--rope-fold", str(plan.rope_fold), *domains, *extra],
        "mla": ["convert", model, "--to", "mla", "--kv-budget", str(budget), *domains, *extra],
        "latent only": ["compress", model, "--method", "svdllm", "--targets", "k,v", "--kv-latent", "--allocate",
                        "--ratio", str(budget), *domains],
    }


def converted(args: list[str], output: Path) -> dict:
    """The --json report of one attnsurg run, run now unless the same command already wrote it there."""
    report, command = output.parent / f"{output.name}.json", output.parent / f"{output.name}.command"
    if not (output / "config.json").is_file() or not report.is_file() or not command.is_file() \
            or command.read_text() != " ".join(args):
        result = subprocess.run([sys.executable, "-m", "attnsurg", "--quiet", *args, "-o", str(output), "--overwrite", "--json"],
                                capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"attnsurg {' '.join(args)} failed:\n{result.stderr[-2000:]}")
        report.write_text(result.stdout)
        command.write_text(" ".join(args))
    return json.loads(report.read_text())


def ratios_of(report: dict) -> dict[str, float]:
    """Per domain, the ratio to the original; the first domain is the run's own evaluation text."""
    first, *others = DOMAINS
    scores = report["domains"]["scores"]
    return {first: report["ppl_after"] / report["ppl_before"]} | {d: scores[d]["ratio"] for d in others}


def facts_kept(model: str, outputs: list[Path]) -> list[tuple[float, float]]:
    report = run_tasks(TasksEval(models=[ModelRef(ref=model)] + [ModelRef(ref=str(o)) for o in outputs], tasks=["facts"], device="cpu"))
    return [(m.retained["facts"]["choice_acc"], m.retained["facts"]["greedy_acc"]) for m in report.models[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--out-dir", type=Path, default=Path("out/mla-floor"))
    parser.add_argument("--facts", action="store_true", help="also the share of the original's facts each keeps")
    parser.add_argument("extra", nargs="*", help="after --: more options for both MLA conversions")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    rows = []
    for budget in args.budgets:
        for name, command in commands(args.model, budget, args.extra).items():
            output = args.out_dir / f"{name.replace(' ', '-')}-{budget:g}"
            report = converted(command, output)
            rows.append({"budget": budget, "name": name, "command": "attnsurg " + " ".join(command),
                         "output": str(output), "ratios": ratios_of(report)})
    if args.facts:
        for row, kept in zip(rows, facts_kept(args.model, [Path(r["output"]) for r in rows]), strict=True):
            row["facts_kept"] = kept

    short = [d.removesuffix("-sample") for d in DOMAINS]
    header = ["budget", "conversion", *short, "worst"] + (["facts kept 4-way / greedy"] if args.facts else [])
    print("| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
    for row in rows:
        worst = max(row["ratios"], key=row["ratios"].get)
        cells = [f"{row['budget']:g}", row["name"], *(f"x{row['ratios'][d]:.3f}" for d in DOMAINS),
                 f"x{row['ratios'][worst]:.3f} {worst.removesuffix('-sample')}"]
        if args.facts:
            cells.append("{:.3f} / {:.3f}".format(*row["facts_kept"]))
        print("| " + " | ".join(cells) + " |")
    for row in rows:
        print(f"{row['budget']:g} {row['name']}: {row['command']}")
    write_result("mla_floor", {"model": args.model, "rows": rows})


if __name__ == "__main__":
    main()
