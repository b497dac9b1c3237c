"""Which layers a tensor compression hurts: one layer compressed at a time, every other layer left dense.

    python benchmarks/layer_sensitivity.py [--model gemma3-270m] [--method tucker] [--ratio 0.5]
                                           [--targets q,k,v,o] [--windows 2] [--calib-tokens 4096]

Calibrates once on the calibration half of wiki-sample, then for each layer L compresses the targeted projections
of L alone at ``--ratio`` (the plan's own ranks, chosen as `compress` chooses them) and scores the model on the
first WINDOWS x 1024 tokens of wiki-sample's evaluation half; then every layer at once, as `compress` does. A
model whose whole-model ratio is far above the product of its one-layer ratios has layers whose errors compound;
one whose ratio is carried by a few layers has layers the budget should spare. Writes
benchmarks/results/layer_sensitivity_<model>_<method>.json.
"""

from __future__ import annotations

import argparse
import math
import time

from attnsurg.methods.base import operate_loaded
from attnsurg.methods.headtensor import plan_head_tensor
from common import prepare, write_result


def only_layer(plan, layer: int | None):
    """The plan with every unit outside ``layer`` kept dense (None: every layer compressed)."""
    if layer is None:
        return plan
    for i, unit in enumerate(plan.units):
        if unit.layer != layer:
            plan.budgets[i] = 2 * unit.dense_params
            plan.ranks[i] = None
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--method", default="tucker", choices=("tucker", "cp"))
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--targets", default="q,k,v,o")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    args = parser.parse_args()

    setup = prepare(args.model, args.windows, args.calib_tokens)
    original = setup.original_ppl
    rows = []
    for layer in [*range(setup.anatomy.num_layers), None]:
        start = time.perf_counter()
        plan = only_layer(plan_head_tensor(setup.anatomy, args.method, args.targets, ratio=args.ratio), layer)
        result = operate_loaded(setup.model, setup.family, setup.stats, plan, setup.seq_len)
        ratio = setup.ppl(result.model) / original
        errors = {f"{unit.name}": error for unit, error in zip(result.plan.units, result.errors, strict=True)
                  if unit.layer == layer}  # each projection's relative error in its whitened space
        rows.append({"layer": "all" if layer is None else layer, "ppl_ratio": ratio, "seconds": time.perf_counter() - start,
                     "errors": errors})
        print(f"layer {rows[-1]['layer']}: x{ratio:.3f} {' '.join(f'{k} {v:.3f}' for k, v in errors.items())}", flush=True)
        del result
    product = math.prod(r["ppl_ratio"] for r in rows[:-1])
    print(f"original ppl {original:.3f}; product of one-layer ratios x{product:.3f}; every layer x{rows[-1]['ppl_ratio']:.3f}")
    write_result(f"layer_sensitivity_{args.model}_{args.method}",
                 {"model": args.model, "method": args.method, "ratio": args.ratio, "targets": args.targets,
                  "windows": args.windows, "original_ppl": original, "product_of_one_layer": product, "rows": rows})


if __name__ == "__main__":
    main()
