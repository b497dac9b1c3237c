"""Healing after MLA conversion: ppl ratio to the original before and after distillation, in one run.

    python benchmarks/heal_budget.py [--budget 0.25] [--tokens 100000] [--windows 4] [--student DIR]
                                     [--lr 2.5e-4] [--batch-size 1] [--seq-len 512] [--hidden-weight 0] [--train attention]

Converts the demo model in memory (default conversion settings; or loads an already converted --student),
scores the original and the student on the first WINDOWS x 1024 tokens of wiki-sample's eval part, heals
on --tokens of its calibration part (KL to the original's logits, accelerate, CPU or GPU) and scores again.
Prints a markdown row with training tokens/s. Writes benchmarks/results/heal_budget.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import calibration_windows
from attnsurg.eval.perplexity import eval_windows, perplexity_of
from attnsurg.heal import heal_model
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.methods.mla.conversion import convert
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.methods.mla.refine import Refinement
from attnsurg.recipe import HealSettings
from attnsurg.requests import TextData
from common import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--student", default=None, help="an already converted checkpoint (skips the conversion)")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--lr", type=float, default=2.5e-4)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--hidden-weight", type=float, default=0.0)
    parser.add_argument("--lm-weight", type=float, default=0.0)
    parser.add_argument("--train", default="attention", choices=["attention", "all"])
    parser.add_argument("--eval-every", type=int, default=0)
    args = parser.parse_args()

    source = resolve_source(args.model)
    teacher, tokenizer = load_model(source), load_tokenizer(source)
    anatomy = inspect_config(teacher.config)
    tokens, plan = eval_windows(tokenizer, TextData(dataset="wiki-sample", part="eval"), 1024, args.windows * 1024)
    original = perplexity_of(teacher, tokens, plan)
    if args.student:
        student = load_model(resolve_source(args.student))
    else:
        windows = calibration_windows(tokenizer, TextData(dataset="wiki-sample", part="calib"), 4096, 512)
        student = convert(teacher, family_for_surgery(anatomy.model_type), windows, plan_mla(anatomy, kv_budget=args.budget),
                          refinement=Refinement()).model
    before = perplexity_of(student, tokens, plan)
    settings = HealSettings(tokens=args.tokens, lr=args.lr, batch_size=args.batch_size, seq_len=args.seq_len,
                            hidden_weight=args.hidden_weight, lm_weight=args.lm_weight, train=args.train,
                            eval_every=args.eval_every)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as state:
        report = heal_model(student, teacher, tokenizer, settings, seed=0, state_dir=Path(state) / "heal")
    seconds = time.perf_counter() - started
    after = perplexity_of(student, tokens, plan)
    row = {"budget": args.budget, "tokens": report.tokens, "steps": report.steps, "original": original,
           "before": before, "after": after, "ratio_before": before / original, "ratio_after": after / original,
           "tokens_per_second": report.tokens_per_second, "seconds": seconds, "settings": settings.model_dump(mode="json"),
           "losses": report.losses, "evals": report.evals}
    print("| KV budget | training tokens | steps | ppl original | before healing | after healing | train tok/s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.budget} | {report.tokens:,} | {report.steps} | {original:.3f} | {before:.3f} (x{before / original:.3f}) "
          f"| {after:.3f} (x{after / original:.3f}) | {report.tokens_per_second:,.0f} |")
    print(f"\nlr {args.lr}, batch {args.batch_size} x {args.seq_len}, train {args.train}, hidden weight {args.hidden_weight}; "
          f"{seconds:.0f} s of healing")
    write_result("heal_budget", row)


if __name__ == "__main__":
    main()
