"""MLA conversion of the demo model at several KV budgets, against the original in the same run.

    python benchmarks/mla_budget.py [--budgets 0.5 0.25 0.125] [--windows 4] [--calib-tokens 4096] [--calib-seq-len 512]
                                    [--unweighted]
                                    [--refine-steps 40] [--refine-tokens 2048] [--refine-queries 128]
                                    [--refine-lr 1e-3] [--refine-schedule constant]
                                    [--rope-layout standard]

Calibrates on the calibration half of wiki-sample, evaluates on the first WINDOWS x 1024 tokens of its
evaluation half (disjoint windows, fp32), converts in memory (closed form, then --refine-steps of layer-wise
refinement; no healing). Prints a markdown table of
ppl ratios, conversion time, and the KV-cache bytes held at 4K context read from the cache objects.
Writes benchmarks/results/mla_budget.json.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from transformers import DynamicCache

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import calibration_windows
from attnsurg.eval.perplexity import eval_windows, perplexity_of
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.methods import mla as mla_method
import attnsurg.methods.mla.refine  # noqa: F401  (mla_method.refine)
from attnsurg.methods.mla.conversion import convert
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.methods.mla.refine import Refinement
from attnsurg.requests import Calibration, TextData
from common import write_result


@torch.no_grad()  # not inference_mode: the dtype round trip would leave inference-tensor weights behind
def cache_bytes_at(model, context: int) -> int:
    """Bytes the transformers cache holds after a forward over ``context`` tokens (bf16 model)."""
    model = model.to(torch.bfloat16)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.zeros(1, context, dtype=torch.long), cache=cache, use_cache=True)
    total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    model.to(torch.float32)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--calib-seq-len", type=int, default=Calibration().seq_len, help="tokens per calibration window")
    parser.add_argument("--unweighted", action="store_true")
    parser.add_argument("--refine-steps", type=int, default=40)
    parser.add_argument("--rope-layout", default="standard", choices=["standard", "flexible"])
    parser.add_argument("--refine-tokens", type=int, default=2048)
    parser.add_argument("--refine-lr", type=float, default=1e-3)
    parser.add_argument("--refine-schedule", default="constant", choices=list(mla_method.refine.SCHEDULES))
    parser.add_argument("--refine-queries", type=int, default=mla_method.refine.REFINE_STEP_QUERIES,
                        help="query positions scored per refinement step")
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    mla_method.refine.REFINE_STEP_QUERIES = args.refine_queries

    source = resolve_source(args.model)
    model, tokenizer = load_model(source), load_tokenizer(source)
    anatomy = inspect_config(model.config)
    family = family_for_surgery(anatomy.model_type)
    evaluation = TextData(dataset="wiki-sample", part="eval")
    tokens, eval_plan = eval_windows(tokenizer, evaluation, 1024, args.windows * 1024)
    original = perplexity_of(model, tokens, eval_plan)
    rows = [{"budget": 1.0, "values": anatomy.kv_values_per_layer, "ppl": original, "ratio": 1.0,
             "convert_s": 0.0, "cache_bytes": cache_bytes_at(model, args.context)}]
    for budget in args.budgets:
        start = time.perf_counter()
        windows = calibration_windows(tokenizer, TextData(dataset="wiki-sample", part="calib"), args.calib_tokens, args.calib_seq_len)
        result = convert(model, family, windows, plan_mla(anatomy, kv_budget=budget, layout=args.rope_layout),
                         not args.unweighted, Refinement(args.refine_steps, args.refine_tokens, args.refine_lr,
                                                         args.refine_schedule))
        mla, plan = result.model, result.plan
        seconds = time.perf_counter() - start
        ppl = perplexity_of(mla, tokens, eval_plan)
        rows.append({"budget": budget, "values": plan.cached_values, "rope_dim": plan.rope_dim, "kv_rank": plan.kv_rank,
                     "rope_counts": list(plan.counts),
                     "ppl": ppl, "ratio": ppl / original, "convert_s": seconds, "cache_bytes": cache_bytes_at(mla, args.context)})
        del mla
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    print(f"| KV budget | values/layer/token | RoPE + latent | ppl | ratio | convert s (incl. calibration) | cache bytes at {args.context} (bf16) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        layout = f"{r['rope_dim']} + {r['kv_rank']} + 1" if "rope_dim" in r else "original"
        print(f"| {r['budget']} | {r['values']} | {layout} | {r['ppl']:.3f} | {r['ratio']:.3f} | {r['convert_s']:.1f} | {r['cache_bytes']:,} |")
    print(f"\npeak memory of this process: {peak:.2f} GB; weighted latent: {not args.unweighted}; "
          f"refinement: {args.refine_steps} steps on {args.refine_tokens} tokens, {args.refine_queries} queries a step, "
          f"lr {args.refine_lr:g} {args.refine_schedule}; calibration windows of {args.calib_seq_len}; RoPE layout: {args.rope_layout}")
    write_result("mla_budget", {"settings": vars(args), "rows": rows, "peak_memory_gb": peak})


if __name__ == "__main__":
    main()
