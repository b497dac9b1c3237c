"""Every shipped recipe at long context: retrieval up to the model's context and perplexity by position.

    python benchmarks/long_context.py [RECIPE ...] [--model smollm2-135m] [--out-dir out/quality]
                                      [--lengths 2048,4096,8192] [--questions 80]
                                      [--ppl-length 8192] [--ppl-windows 2] [--ppl-text wiki-sample]

The long-context half of `benchmarks/quality_matrix.py` (same recipes, same checkpoints under OUT_DIR, each run
with `attnsurg run` unless already there). For the original and every result:

- retrieval (`eval tasks --tasks retrieval`, multikey: 16 needles a haystack, each asked in turn) at each
  length: the rate with its standard error, and the share of the original's hits kept;
- perplexity by position: PPL_WINDOWS windows of PPL_LENGTH tokens from the start of PPL_TEXT's eval part,
  each position band's perplexity as a ratio to the original's (the last band is where a method that forgets
  beyond its window or its calibration length shows).

Lengths default to the model's context (capped at 16K) and its half and quarter: 2K / 4K / 8K on the demo,
4K / 8K / 16K on Qwen2.5-Coder. Scores are cached in OUT_DIR/NAME.long.json by settings, so recipes can be
added in later runs. Writes results/long_context[-MODEL].json, which `benchmarks/results_doc.py` adds to
docs/results.md once copied into docs/results/.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from attnsurg.eval.perplexity import run_perplexity
from attnsurg.eval.tasks import run_tasks
from attnsurg.eval.tasks.base import retained
from attnsurg.io.load import load_config, resolve_source
from attnsurg.io.recipe_file import shipped_recipes
from attnsurg.requests import ModelRef, PerplexityEval, TasksEval, TextData
from common import cached_by_settings, write_result
from quality_matrix import DEMO, checkpoint_for, refusal
from results_doc import long_context_table

LONGEST_DEFAULT = 16384  # past it a CPU run takes hours: ask for longer lengths by name


def default_lengths(context: int) -> list[int]:
    top = min(context, LONGEST_DEFAULT)
    return [top // 4, top // 2, top]


def scores_of(model: str, settings: dict, cache: Path) -> dict:
    """Retrieval items and position-band perplexities of one model, cached by settings."""
    return cached_by_settings(cache, settings, lambda: scored(model, settings))


def scored(model: str, settings: dict) -> dict:
    start = time.perf_counter()
    tasks = run_tasks(TasksEval(models=[ModelRef(ref=model)], tasks=["retrieval"], device="cpu",
                                retrieval_lengths=settings["lengths"], retrieval_questions=settings["questions"]))
    result = tasks.models[0].results["retrieval"]
    retrieval_seconds = time.perf_counter() - start
    ppl = run_perplexity(PerplexityEval(models=[ModelRef(ref=model)], data=TextData(dataset=settings["ppl_text"]),
                                        max_length=settings["ppl_length"], by_position=True, device="cpu",
                                        max_tokens=settings["ppl_windows"] * settings["ppl_length"]))
    return {"settings": settings, "retrieval_items": {str(n): result.items[f"acc {n}"] for n in settings["lengths"]},
              "retrieval_stderr": result.details["stderr_by_length"], "ppl_by_position": ppl.results[0].ppl_by_position,
              "seconds": {"retrieval": retrieval_seconds, "perplexity": time.perf_counter() - start - retrieval_seconds}}


def row_of(name: str, record: dict, original: dict) -> dict:
    items, first = record["retrieval_items"], original["retrieval_items"]
    return {
        "name": name,
        "retrieval": {n: sum(credits) / len(credits) for n, credits in items.items()},
        "retrieval_stderr": record["retrieval_stderr"],
        "retrieval_kept": {n: retained(first[n], credits) for n, credits in items.items()},
        "ppl_ratio_by_position": {band: ppl / original["ppl_by_position"][band]
                                  for band, ppl in record["ppl_by_position"].items()},
        "seconds": record["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="shipped recipe names (default: all)")
    parser.add_argument("--model", default=DEMO)
    parser.add_argument("--out-dir", type=Path, default=None, help="default out/quality (the demo), out/quality-MODEL")
    parser.add_argument("--lengths", default=None, help="retrieval lengths (default: the context, its half, quarter)")
    parser.add_argument("--questions", type=int, default=80, help="retrieval questions per length")
    parser.add_argument("--ppl-length", type=int, default=None, help="perplexity window (default: the longest length)")
    parser.add_argument("--ppl-windows", type=int, default=2)
    parser.add_argument("--ppl-text", default="wiki-sample")
    args = parser.parse_args()

    names = args.recipes or [p.stem for p in shipped_recipes()]
    label = Path(args.model).name
    out_dir = args.out_dir or Path("out/quality" if args.model == DEMO else f"out/quality-{label}")
    out_dir.mkdir(parents=True, exist_ok=True)
    context = load_config(resolve_source(args.model)).max_position_embeddings
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else default_lengths(context)
    settings = {"lengths": lengths, "questions": args.questions, "ppl_length": args.ppl_length or max(lengths),
                "ppl_windows": args.ppl_windows, "ppl_text": args.ppl_text}
    original = scores_of(args.model, settings, out_dir / f"{label}.long.json")
    rows = [row_of("original", original, original)]
    for name in names:
        if reason := refusal(name, args.model):
            rows.append({"name": name, "refused": reason})
            continue
        checkpoint, _ = checkpoint_for(name, out_dir, args.model)
        rows.append(row_of(name, scores_of(str(checkpoint), settings, out_dir / f"{name}.long.json"), original))
        print(long_context_table(rows), flush=True)  # so far: a long run shows each row as it comes
    write_result(f"long_context{'' if args.model == DEMO else '-' + label}",
                 {"model": args.model, "context": context, "settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
