"""The trivial baseline for a fixed-size cache: attention over the last W keys and the first S (StreamingLLM's
attention sinks, Xiao et al. 2024) with every other key dropped, on the original weights, no training.

    python benchmarks/window_sinks.py [--model smollm2-135m] [--window 64,128,256] [--sinks 0,1,4,8] [--windows 2]

A hybrid linear conversion (``convert --to linear``) keeps the same exact keys and adds a linear attention over
the dropped ones, so it is worth its training only where it beats this. Prints the perplexity ratio to the
original on WINDOWS x 1024 tokens of each domain's eval part (the quality matrix's windows) for each window
and sink count, and writes benchmarks/results/window_sinks-MODEL.json.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from attnsurg.data import DOMAINS
from attnsurg.eval.perplexity import perplexity_of, scoring_windows
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.requests import TextData
from common import write_result

KERNEL = "window_and_sinks"


def window_and_sinks(window: int, sinks: int):
    """An attention function for transformers: causal, each query sees the last ``window`` keys (itself
    included) and the first ``sinks``."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        queries, keys = query.shape[2], key.shape[2]
        position = torch.arange(queries, device=query.device)[:, None] + (keys - queries)
        distance = position - torch.arange(keys, device=query.device)[None, :]
        seen = (distance >= 0) & ((distance < window) | (torch.arange(keys, device=query.device)[None, :] < sinks))
        mask = torch.zeros(seen.shape, dtype=query.dtype, device=query.device).masked_fill(~seen, float("-inf"))
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, mask[None, None], is_causal=False, **kwargs)

    return attention


def domain_ppl(model, tokenizer, windows: int) -> dict[str, float]:
    scores = {}
    for domain in DOMAINS:
        tokens, plan = scoring_windows(tokenizer, TextData(dataset=domain), windows * 1024, None)
        scores[domain] = perplexity_of(model, tokens, plan, domain)
    return scores


def numbers(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--window", default="64", help="keys of the window, or several, comma-separated")
    parser.add_argument("--sinks", default="0,1,4,8")
    parser.add_argument("--windows", type=int, default=2, help="1024-token windows per domain")
    args = parser.parse_args()

    source = resolve_source(args.model)
    tokenizer = load_tokenizer(source)
    model = load_model(source, torch.float32)
    with torch.no_grad():
        original = domain_ppl(model, tokenizer, args.windows)
        rows = []
        for window, sinks in itertools.product(numbers(args.window), numbers(args.sinks)):
            AttentionInterface.register(KERNEL, window_and_sinks(window, sinks))
            model.set_attn_implementation(KERNEL)
            ppl = domain_ppl(model, tokenizer, args.windows)
            ratios = {d: ppl[d] / original[d] for d in DOMAINS}
            worst = max(ratios, key=ratios.get)
            rows.append({"window": window, "sinks": sinks, "ppl": ppl, "ratios": ratios, "worst": worst})
            print(f"window {window}, sinks {sinks}: " + ", ".join(f"{d.split('-')[0]} x{r:.3f}" for d, r in ratios.items())
                  + f"; worst x{ratios[worst]:.3f} {worst.split('-')[0]}", flush=True)
    suffix = "" if args.window == "64" else f"-w{args.window.replace(',', '-')}"
    write_result(f"window_sinks-{args.model}{suffix}", {"settings": vars(args), "original_ppl": original, "rows": rows})


if __name__ == "__main__":
    main()
