"""Decode and prefill speed of converted checkpoints against the original, timed in the same run (`attnsurg
eval speed`; MLA checkpoints in attnsurg's runtime and in transformers' stock DeepseekV3).

    python benchmarks/decode_runtime.py ORIGINAL CONVERTED [CONVERTED ...] [--contexts 1024,4096,8160] [--batch 1]
        [--new-tokens 32] [--repeats 1] [--warmup 0] [--runtimes attnsurg,stock]
        [--name decode_runtime]

Writes benchmarks/results/NAME.json (the speed report and its provenance) and prints one row per model,
runtime and context: tokens/s and peak memory, and their ratios to the original's.
"""

from __future__ import annotations

import argparse

from attnsurg.eval.speed import run_speed
from attnsurg.requests import ModelRef, SpeedEval
from common import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="the original first, then the converted checkpoints")
    parser.add_argument("--contexts", default="1024,4096,8160")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runtimes", default="attnsurg,stock", help="the runtimes timed, comma-separated")
    parser.add_argument("--name", default="decode_runtime")
    args = parser.parse_args()
    request = SpeedEval(models=[ModelRef(ref=m) for m in args.models],
                        contexts=[int(c) for c in args.contexts.split(",")], new_tokens=args.new_tokens,
                        repeats=args.repeats, warmup=args.warmup, batch=args.batch, device=args.device,
                        runtimes=args.runtimes.split(","))
    report = run_speed(request)
    original = {c.context: c for c in report.models[0].contexts}
    print("| model | runtime | context | decode tok/s | x original | prefill tok/s | x original | peak GiB | x original |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in report.models:
        for c in model.contexts:
            first = original[c.context]
            peak = (c.peak_memory_bytes or 0) / 2**30
            peak_ratio = c.peak_memory_bytes / first.peak_memory_bytes if first.peak_memory_bytes else float("nan")
            print(f"| {model.model} | {model.runtime or '-'} | {c.context} | {c.decode_tokens_per_second:.1f} | "
                  f"x{model.ratios[str(c.context)]['decode']:.2f} | {c.prefill_tokens_per_second:.0f} | "
                  f"x{model.ratios[str(c.context)]['prefill']:.2f} | {peak:.2f} | x{peak_ratio:.2f} |")
    print(write_result(args.name, {"request": request.model_dump(mode="json"), **report.to_dict()}))


if __name__ == "__main__":
    main()
