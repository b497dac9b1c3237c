"""Loki on the demo model: ppl and top-k recall over rank x top-k, and decode-attention speed vs dense.

    python benchmarks/loki_budget.py [--ranks 8 16 32] [--top-k 128 256 512] [--windows 4] [--contexts 4096 16384]

Quality: WINDOWS x 1024 tokens of wiki-sample's evaluation half, original in the same run; top-k as a
count per query (128/256/512 = 1/8, 1/4, 1/2 of a window, Loki's convention); recall of the exact top-k on
the first window. Speed: one new token against a cache filled with CONTEXT random tokens, for one
attention layer and for the whole model, Loki (rank 32, top-k 1/4 of the context) against the original,
median of repeated runs on this machine's CPU threads. Writes benchmarks/results/loki_budget.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from attnsurg.methods.base import operate_loaded
from attnsurg.methods.loki import plan_loki, top_k_recall
from attnsurg.modeling.modeling_attnsurg import LokiAttention
from common import prepare, write_result


def filled_cache(model, context: int) -> DynamicCache:
    """A cache holding ``context`` random tokens per layer in the model's layout (Loki: scored prefix in the
    key slot, the rest of the key and the value in the value slot); timing does not depend on values."""
    config = model.config
    cache = DynamicCache(config=config)
    d = config.head_dim
    attention = model.model.layers[0].self_attn
    widths = (attention.rank, 2 * d - attention.rank) if isinstance(attention, LokiAttention) else (d, d)
    for index in range(config.num_hidden_layers):
        keys, values = (torch.randn(1, config.num_key_value_heads, context, w) for w in widths)
        cache.update(keys, values, index)
    return cache


@torch.inference_mode()
def decode_seconds(model, context: int, whole_model: bool, repeats: int = 7) -> float:
    """Median seconds of one new token's attention (layer 0) or forward (whole model) at ``context``."""
    times = []
    for _ in range(repeats):
        cache = filled_cache(model, context)
        token = torch.zeros(1, 1, dtype=torch.long)
        position = torch.tensor([[context]])
        if whole_model:
            start = time.perf_counter()
            model(input_ids=token, cache=cache, use_cache=True, position_ids=position)
        else:
            layer = model.model.layers[0].self_attn
            hidden = torch.randn(1, 1, model.config.hidden_size)
            embeddings = model.model.rotary_emb(hidden, position)
            start = time.perf_counter()
            layer(hidden_states=hidden, position_embeddings=embeddings, attention_mask=None, cache=cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--top-k", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384])
    args = parser.parse_args()

    setup = prepare(args.model, args.windows, args.calib_tokens, args.calib_seq_len)
    first_window = setup.tokens.ids[None, :1024]
    rows = []
    for rank in args.ranks:
        for top_k in args.top_k:
            plan = plan_loki(setup.anatomy, rank, top_k)
            model = operate_loaded(setup.model, setup.family, setup.stats, plan, setup.seq_len).model
            ppl = setup.ppl(model)
            recall = top_k_recall(model, first_window)
            rows.append({"rank": rank, "top_k": top_k, "ppl": ppl, "ppl_ratio": ppl / setup.original_ppl, "recall": recall})
            print(f"rank {rank}, top-k {top_k}: x{ppl / setup.original_ppl:.3f}, recall {recall:.3f}", flush=True)
    speed = []
    for context in args.contexts:
        loki = operate_loaded(setup.model, setup.family, setup.stats, plan_loki(setup.anatomy, 32, context // 4), setup.seq_len).model
        for whole in (False, True):
            dense_s, loki_s = decode_seconds(setup.model, context, whole), decode_seconds(loki, context, whole)
            speed.append({"context": context, "scope": "model" if whole else "layer", "dense_s": dense_s,
                          "loki_s": loki_s, "speedup": dense_s / loki_s})
            print(f"context {context}, {'model' if whole else 'layer'}: dense {dense_s * 1e3:.2f} ms, "
                  f"loki {loki_s * 1e3:.2f} ms, x{dense_s / loki_s:.2f}", flush=True)
    print(f"\noriginal ppl {setup.original_ppl:.3f}\n")
    print("| rank \\ top-k | " + " | ".join(str(k) for k in args.top_k) + " |")
    print("|---" * (len(args.top_k) + 1) + "|")
    for rank in args.ranks:
        cells = [f"x{r['ppl_ratio']:.3f} ({r['recall']:.2f})" for r in rows if r["rank"] == rank]
        print(f"| {rank} | " + " | ".join(cells) + " |")
    print("\n| context | scope | dense ms | loki ms (r 32, k 1/4) | speedup |\n|---|---|---|---|---|")
    for s in speed:
        print(f"| {s['context']} | {s['scope']} | {s['dense_s'] * 1e3:.2f} | {s['loki_s'] * 1e3:.2f} | x{s['speedup']:.2f} |")
    write_result("loki_budget", {"original_ppl": setup.original_ppl, "rows": rows, "speed": speed})


if __name__ == "__main__":
    main()
