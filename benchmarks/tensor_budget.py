"""Tucker and CP against SVD-LLM on the demo model at equal attention parameters, in one run.

    python benchmarks/tensor_budget.py [--ratios 0.75 0.5 0.35] [--windows 4] [--calib-tokens 4096] [--calib-seq-len 512]

Calibrates once on the calibration half of wiki-sample (statistics shared by every row), evaluates on the
first WINDOWS x 1024 tokens of its evaluation half (disjoint windows, fp32), q,k,v,o targeted, no
healing. Rows per ratio: svdllm (plain whitening), svdllm, tucker, cp and stacked tucker (q, k, v, o in one
decomposition, TensorLLM layout) (consumer-weighted, the defaults; ``--plain-tensor`` adds tucker and cp
with whitened inputs only; ``--data-free-stacked`` adds stacked tucker with TensorLLM's data-free factors,
only its cores fitted to the calibration data);
each with ppl ratio to the original, parameters and FLOPs per token in the projections, KV bytes per
token (bf16, from a transformers cache) and decomposition seconds (calibration excluded, reported once).
Writes benchmarks/results/tensor_budget.json.
"""

from __future__ import annotations

import argparse
import time

from attnsurg.methods.base import operate_loaded
from attnsurg.methods.headtensor import plan_head_tensor
from attnsurg.methods.lowrank import plan_lowrank
from attnsurg.methods.stacked_tucker import MAX_ITERATIONS, plan_stacked_tucker
from common import cache_bytes_per_token, prepare, write_result

TARGETS = "q,k,v,o"


def variants(anatomy, ratio: float, plain_tensor: bool, data_free_stacked: bool):
    for weighted in (False, True):
        name = "consumer-weighted" if weighted else "plain whitening"
        yield f"svdllm ({name})", plan_lowrank(anatomy, "svdllm", TARGETS, ratio=ratio, weighted=weighted)
    for method in ("tucker", "cp"):
        for weighted in (False, True) if plain_tensor else (True,):
            name = "consumer-weighted" if weighted else "whitened inputs only"
            yield f"{method} ({name})", plan_head_tensor(anatomy, method, TARGETS, ratio=ratio, weighted=weighted)
    for sweeps in (0, None) if data_free_stacked else (None,):
        label = "data-free factors, fitted cores" if sweeps == 0 else "consumer-weighted"
        yield f"stacked tucker ({label})", (plan_stacked_tucker(anatomy, tuple(TARGETS.split(",")), ratio=ratio), sweeps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.75, 0.5, 0.35])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--plain-tensor", action="store_true", help="Also tucker and cp without consumer weights.")
    parser.add_argument("--data-free-stacked", action="store_true", help="Also stacked tucker with data-free factors.")
    args = parser.parse_args()

    setup = prepare(args.model, args.windows, args.calib_tokens, args.calib_seq_len)
    original, calibration_s = setup.original_ppl, setup.calibration_s
    rows = []
    for ratio in args.ratios:
        for label, plan in variants(setup.anatomy, ratio, args.plain_tensor, args.data_free_stacked):
            start = time.perf_counter()
            if label.startswith("stacked"):
                plan, sweeps = plan
                plan.max_iterations = MAX_ITERATIONS if sweeps is None else sweeps
            result = operate_loaded(setup.model, setup.family, setup.stats, plan, setup.seq_len)
            seconds = time.perf_counter() - start
            ppl = setup.ppl(result.model)
            plan = result.plan
            rows.append({"ratio": ratio, "variant": label, "kept": plan.kept_fraction, "ppl": ppl, "ppl_ratio": ppl / original,
                         "params": plan.params_after(), "flops_per_token": plan.flops_after(),
                         "kv_bytes_per_token": cache_bytes_per_token(result.model), "decompose_s": seconds})
            print(f"{ratio} {label}: x{ppl / original:.3f} in {seconds:.1f} s", flush=True)
    print(f"\noriginal ppl {original:.3f}; projection params {plan.params_before():,}, FLOPs/token {plan.flops_before():,}; "
          f"calibration {calibration_s:.1f} s (shared)\n")
    print("| kept (target) | variant | kept | ppl | ratio | projection params | FLOPs/token | KV B/token (bf16) | decompose s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ratio']} | {r['variant']} | {r['kept']:.3f} | {r['ppl']:.3f} | {r['ppl_ratio']:.3f} | {r['params']:,} | "
              f"{r['flops_per_token']:,} | {r['kv_bytes_per_token']:,.0f} | {r['decompose_s']:.1f} |")
    write_result("tensor_budget", {"original_ppl": original, "calibration_s": calibration_s, "rows": rows})


if __name__ == "__main__":
    main()
