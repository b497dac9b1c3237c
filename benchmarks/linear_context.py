"""Hybrid linear checkpoints at the context lengths a fixed-size cache is for: the same tokens of each domain
scored with 1K, 4K or 8K tokens of context before them.

    python benchmarks/linear_context.py CHECKPOINT [CHECKPOINT ...] [--model smollm2-135m]
        [--contexts 1024,4096,8192] [--scored 512] [--spans 2] [--decays 0.003] [--reference RESULT] [--name NAME]

For each domain, SPANS stretches of SCORED tokens of its eval part (the ones ending at 8192, 16384, ...) are
scored with CONTEXT tokens in front (the scored ones included), so a column compares the same tokens. Rows:
the original (MODEL); the trivial baseline of the first checkpoint's window and sinks with every older key
dropped (benchmarks/window_sinks.py's); each checkpoint as written; and with ``--decays``, each checkpoint
with its linear part faded by exp(-delta (i - j)) at every delta given (for checkpoints converted without a
decay). ``--reference`` takes the original's row, and the baseline's where its window and sinks are the same,
from an earlier result of the same model and settings instead of scoring them again. The perplexity ratios
are to the original at the same context. Where the linear part helps, a row
falls below the baseline's as the context grows; where it is over-weighted, it rises. Writes
benchmarks/results/linear_context-NAME.json.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AttentionInterface

from attnsurg.data import DOMAINS
from attnsurg.eval.perplexity import eval_windows, perplexity_of
from attnsurg.eval.windows import Window
from attnsurg.io.load import load_config, load_model, load_tokenizer, resolve_source
from attnsurg.modeling.modeling_attnsurg import HybridLinearAttention
from attnsurg.requests import TextData
from common import record_start, write_result
from window_sinks import KERNEL, numbers, window_and_sinks


def scored_spans(tokens_available: int, context: int, scored: int, spans: int, longest: int) -> list[Window]:
    """Windows of ``context`` tokens ending where each span of ``scored`` tokens ends (at multiples of
    ``longest``), only those tokens scored."""
    ends = [longest * (k + 1) for k in range(spans) if longest * (k + 1) <= tokens_available]
    return [Window(end - context, end, end - scored) for end in ends]


def domain_scores(model, tokenizer, contexts: list[int], scored: int, spans: int) -> dict[int, dict[str, float]]:
    """Perplexity per context and domain on the same scored tokens."""
    longest = max(contexts)
    scores: dict[int, dict[str, float]] = {c: {} for c in contexts}
    for domain in DOMAINS:
        tokens, _ = eval_windows(tokenizer, TextData(dataset=domain, part="eval"), 1024, longest * spans)
        for context in contexts:
            windows = scored_spans(len(tokens.ids), context, scored, spans, longest)
            scores[context][domain] = perplexity_of(model, tokens, windows, f"{domain} at {context}")
    return scores


def hybrid_attentions(model) -> list[HybridLinearAttention]:
    return [m for m in model.modules() if isinstance(m, HybridLinearAttention)]


def with_decay(model, decay: float) -> None:
    """Fade every layer's linear part by exp(-decay) per token of distance."""
    for attention in hybrid_attentions(model):
        value = torch.full((attention.num_key_value_heads,), math.log(decay) if decay > 0 else -math.inf)
        attention.log_decay = torch.nn.Parameter(value)


def row(name: str, scores: dict, original: dict) -> dict:
    ratios = {c: {d: scores[c][d] / original[c][d] for d in DOMAINS} for c in scores}
    worst = {c: max(ratios[c], key=ratios[c].get) for c in scores}
    for context in scores:
        print(f"{name} at {context}: " + ", ".join(f"{d.split('-')[0]} x{r:.3f}" for d, r in ratios[context].items())
              + f"; worst x{ratios[context][worst[context]]:.3f} {worst[context].split('-')[0]}", flush=True)
    return {"name": name, "ppl": scores, "ratios": ratios, "worst": worst}


def reference_rows(args, source, tokenizer, contexts: list[int]) -> list[dict]:
    """The original's row, and the baseline's at the first checkpoint's window and sinks: each taken from
    ``--reference`` where that scored it the same way, else scored here."""
    earlier = {r["name"]: {**r, "ppl": {int(c): v for c, v in r["ppl"].items()}} for r in earlier_rows(args)}
    first = load_config(resolve_source(args.checkpoints[0])).attnsurg["linear"]
    window, sinks = int(first["window"]), int(first.get("sinks", 0))
    rows, model = [], None
    for name, attention in (("original", None),
                            (f"window {window} + {sinks} sinks, older keys dropped", window_and_sinks(window, sinks))):
        if name in earlier:
            rows.append(earlier[name])
            continue
        model = model or load_model(source, torch.float32)
        if attention is not None:
            AttentionInterface.register(KERNEL, attention)
            model.set_attn_implementation(KERNEL)
        scores = domain_scores(model, tokenizer, contexts, args.scored, args.spans)
        rows.append(row(name, scores, rows[0]["ppl"] if rows else scores))
    return rows


def earlier_rows(args) -> list[dict]:
    """The rows of ``--reference`` (none without one), which must have been scored the same way."""
    if args.reference is None:
        return []
    earlier = json.loads(args.reference.read_text())
    same = ("model", "contexts", "scored", "spans")
    if any(earlier["settings"][key] != getattr(args, key) for key in same):
        raise SystemExit(f"--reference: {args.reference} was scored with other {', '.join(same)}")
    return earlier["rows"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--model", default="smollm2-135m", help="the original the checkpoints were converted from")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--scored", type=int, default=512, help="tokens scored per span")
    parser.add_argument("--spans", type=int, default=2, help="spans scored per domain")
    parser.add_argument("--decays", default="", help="decays per token to fade the linear part by, comma-separated")
    parser.add_argument("--reference", type=Path, default=None, help="an earlier result to take the original and the baseline from")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    record_start()

    contexts = numbers(args.contexts)
    args.scored = min(args.scored, min(contexts) - 1)  # a window's first token is context only
    source = resolve_source(args.model)
    tokenizer = load_tokenizer(source)
    with torch.no_grad():
        rows = reference_rows(args, source, tokenizer, contexts)
        original = rows[0]["ppl"]
        for checkpoint in args.checkpoints:
            model = load_model(resolve_source(checkpoint), torch.float32)
            name = Path(checkpoint).name
            rows.append(row(name, domain_scores(model, tokenizer, contexts, args.scored, args.spans), original))
            for decay in (float(d) for d in args.decays.split(",") if d):
                with_decay(model, decay)
                scores = domain_scores(model, tokenizer, contexts, args.scored, args.spans)
                rows.append(row(f"{name}, decay {decay:g}", scores, original))
    name = args.name or "-".join(Path(c).name for c in args.checkpoints)
    settings = {**vars(args), "reference": str(args.reference) if args.reference else None}
    write_result(f"linear_context-{name}", {"settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
