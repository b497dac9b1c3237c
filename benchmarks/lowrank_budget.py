"""Low-rank compression of the demo model: every method against the original in the same run.

    python benchmarks/lowrank_budget.py [--kv-ratios 0.5 0.25] [--param-ratio 0.6] [--windows 4] [--calib-tokens 4096] [--calib-seq-len 512]

Calibrates once on the calibration half of wiki-sample (statistics shared by every row), evaluates on the
first WINDOWS x 1024 tokens of its evaluation half (disjoint windows, fp32), no healing. Two tables:

- k/v latent (``--kv-latent``) at each KV ratio: svd, asvd, svdllm (plain), svdllm (consumer-weighted),
  svdllm weighted + allocate;
- q,k,v,o at ``--param-ratio`` of the attention parameters: the same five rows.

Each row: ppl, ratio to the original, kept fraction, factorization seconds (calibration excluded, reported
once), KV bytes/token (bf16) read from a transformers cache after a forward. Writes
benchmarks/results/lowrank_budget.json.
"""

from __future__ import annotations

import argparse
import time

from attnsurg.methods.base import operate_loaded
from attnsurg.methods.lowrank import plan_lowrank
from common import Setup, cache_bytes_per_token, prepare, write_result

VARIANTS = [  # label, method, weighted, allocate
    ("svd", "svd", False, False),
    ("asvd", "asvd", False, False),
    ("svdllm (plain whitening)", "svdllm", False, False),
    ("svdllm + consumer weights", "svdllm", True, False),
    ("svdllm + weights + allocate", "svdllm", True, True),
]


def run_rows(setup: Setup, ratio: float, targets: str, kv_latent: bool) -> list[dict]:
    rows, original = [], setup.original_ppl
    for label, method, weighted, allocate in VARIANTS:
        plan = plan_lowrank(setup.anatomy, method, targets, ratio=ratio, kv_latent=kv_latent, allocate=allocate, weighted=weighted)
        start = time.perf_counter()
        result = operate_loaded(setup.model, setup.family, setup.stats, plan, setup.seq_len)
        seconds = time.perf_counter() - start
        ppl = setup.ppl(result.model)
        rows.append({"variant": label, "ratio_requested": ratio, "kept": result.plan.kept_fraction, "ppl": ppl,
                     "ppl_ratio": ppl / original, "factorize_s": seconds,
                     "kv_bytes_per_token": cache_bytes_per_token(result.model),
                     "params_after": result.plan.params_after(), "flops_after": 2 * result.plan.params_after()})
        print(f"  {label}: ppl {ppl:.3f} (x{ppl / original:.3f}), {seconds:.1f} s", flush=True)
    return rows


def print_table(title: str, rows: list[dict], original: float) -> None:
    print(f"\n{title} (original ppl {original:.3f})\n")
    print("| variant | kept | ppl | ratio | factorize s | KV B/token (bf16) | projection params |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['kept']:.3f} | {r['ppl']:.3f} | {r['ppl_ratio']:.3f} | {r['factorize_s']:.1f} | "
              f"{r['kv_bytes_per_token']:,.0f} | {r['params_after']:,} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--kv-ratios", type=float, nargs="*", default=[0.5, 0.25])
    parser.add_argument("--param-ratio", type=float, nargs="*", default=[0.6])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    args = parser.parse_args()

    setup = prepare(args.model, args.windows, args.calib_tokens, args.calib_seq_len)
    original, calibration_s = setup.original_ppl, setup.calibration_s
    record = {"original_ppl": original, "calibration_s": calibration_s,
              "original_kv_bytes_per_token": cache_bytes_per_token(setup.model), "tables": {}}
    for ratio in args.kv_ratios:
        print(f"k/v latent at {ratio} of the KV cache", flush=True)
        rows = run_rows(setup, ratio, "k,v", True)
        record["tables"][f"kv_latent_{ratio}"] = rows
    for ratio in args.param_ratio:
        print(f"q,k,v,o at {ratio} of the attention parameters", flush=True)
        rows = run_rows(setup, ratio, "q,k,v,o", False)
        record["tables"][f"qkvo_{ratio}"] = rows
    print(f"\ncalibration ({args.calib_tokens} tokens, shared by every row): {calibration_s:.1f} s; "
          f"original KV B/token (bf16): {record['original_kv_bytes_per_token']:,.0f}")
    for name, rows in record["tables"].items():
        print_table(name.replace("_", " "), rows, original)
    write_result("lowrank_budget", record)


if __name__ == "__main__":
    main()
