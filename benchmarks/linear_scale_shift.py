"""Whether a hybrid linear checkpoint weighs its linear part right at the evaluation length: every layer's
linear weight exp(lambda_h) multiplied by exp(shift), the six domains scored at each shift.

    python benchmarks/linear_scale_shift.py CHECKPOINT [--model smollm2-135m] [--shifts 0,-1,-2,-30] [--windows 2]
        [--decays 0.001,0.003] [--name NAME]

A shift of 0 is the checkpoint as written; a large negative one drops the linear part (the window and the sinks
alone, as benchmarks/window_sinks.py scores them). A best shift below 0 means the linear part takes too much of
each query's attention at this length. ``--decays`` adds rows at shift 0 with every layer's linear part faded
by exp(-delta (i - j)) (for checkpoints converted without a decay). Perplexity ratios are to the original (MODEL) on WINDOWS x 1024 tokens of
each domain's eval part; writes benchmarks/results/linear_scale_shift-NAME.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnsurg.data import DOMAINS
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.modeling.modeling_attnsurg import HybridLinearAttention
from common import write_result
from linear_context import with_decay
from window_sinks import domain_ppl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--model", default="smollm2-135m", help="the original the checkpoint was converted from")
    parser.add_argument("--shifts", default="0,-1,-2,-30")
    parser.add_argument("--windows", type=int, default=2, help="1024-token windows per domain")
    parser.add_argument("--decays", default="", help="decays per token, comma-separated, each scored at shift 0")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()

    source = resolve_source(args.model)
    tokenizer = load_tokenizer(source)
    with torch.no_grad():
        original = domain_ppl(load_model(source, torch.float32), tokenizer, args.windows)
        model = load_model(resolve_source(args.checkpoint), torch.float32)
        attentions = [m for m in model.modules() if isinstance(m, HybridLinearAttention)]
        written = [a.linear_scale.clone() for a in attentions]
        rows = []
        for shift in (float(s) for s in args.shifts.split(",") if s):
            for attention, scale in zip(attentions, written, strict=True):
                attention.linear_scale.copy_(scale + shift)
            rows.append(scored_row(f"shift {shift:g}", {"shift": shift}, model, tokenizer, original, args.windows))
        for attention, scale in zip(attentions, written, strict=True):
            attention.linear_scale.copy_(scale)
        for decay in (float(d) for d in args.decays.split(",") if d):
            with_decay(model, decay)
            rows.append(scored_row(f"decay {decay:g}", {"shift": 0.0, "decay": decay}, model, tokenizer, original,
                                   args.windows))
    write_result(f"linear_scale_shift-{args.name or Path(args.checkpoint).name}",
                 {"settings": vars(args), "original_ppl": original, "rows": rows})


def scored_row(label: str, setting: dict, model, tokenizer, original: dict, windows: int) -> dict:
    ppl = domain_ppl(model, tokenizer, windows)
    ratios = {d: ppl[d] / original[d] for d in DOMAINS}
    worst = max(ratios, key=ratios.get)
    print(f"{label}: " + ", ".join(f"{d.split('-')[0]} x{r:.3f}" for d, r in ratios.items())
          + f"; worst x{ratios[worst]:.3f} {worst.split('-')[0]}", flush=True)
    return {**setting, "ppl": ppl, "ratios": ratios, "worst": worst}


if __name__ == "__main__":
    main()
