"""Which layers a tensor compression hurts: one layer compressed at a time, every other layer left dense.

    python benchmarks/layer_sensitivity.py [--model gemma3-270m] [--method tucker] [--ratio 0.5]
                                           [--targets q,k,v,o] [--windows 2] [--calib-tokens 4096]

Calibrates once on the calibration half of wiki-sample, then for each layer L compresses the targeted projections
of L alone at ``--ratio`` (the plan's own ranks, chosen as `compress` chooses them) and scores the model on the
first WINDOWS x 1024 tokens of wiki-sample's evaluation half; then every layer at once, as `compress` does. A
model whose whole-model ratio is far above the product of its one-layer ratios has layers whose errors compound;
one whose ratio is carried by a few layers has layers the budget should spare. ``--restream`` then fits every
layer again on the statistics of the compressed model's own stream (each layer's inputs as the compressed
layers before it make them), which a drift between the streams would show. Writes
benchmarks/results/layer_sensitivity_<model>_<method>.json.
"""

from __future__ import annotations

import argparse
import math
import time

from attnsurg.calibrate import attention_layers, calibration_windows, input_statistics
from attnsurg.methods.base import operate_loaded
from attnsurg.methods.headtensor import plan_head_tensor
from attnsurg.requests import TextData
from common import prepare, write_result


def restreamed_statistics(compressed, setup, calib_tokens: int) -> list:
    """Each layer's (attention input, o_proj input) statistics on the calibration windows as ``compressed`` runs
    them: the stream its own compressed layers make."""
    calib = calibration_windows(setup.tokenizer, TextData(dataset="wiki-sample", part="calib"), calib_tokens, setup.seq_len)
    attentions = attention_layers(compressed, setup.family)
    flat = input_statistics(compressed, attentions + [a.o_proj for a in attentions], calib)
    return list(zip(flat[: len(attentions)], flat[len(attentions):]))


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
    parser.add_argument("--restream", action="store_true", help="Also refit on the compressed model's own stream.")
    parser.add_argument("--layers", default=None, help="The one-layer rows to run: a comma list (default: every layer).")
    args = parser.parse_args()

    setup = prepare(args.model, args.windows, args.calib_tokens)
    original = setup.original_ppl
    rows = []
    layers = range(setup.anatomy.num_layers) if args.layers is None else [int(i) for i in args.layers.split(",") if i]
    for layer in [*layers, None]:
        start = time.perf_counter()
        plan = only_layer(plan_head_tensor(setup.anatomy, args.method, args.targets, ratio=args.ratio), layer)
        result = operate_loaded(setup.model, setup.family, setup.stats, plan, setup.seq_len)
        ratio = setup.ppl(result.model) / original
        errors = {f"{unit.name}": error for unit, error in zip(result.plan.units, result.errors, strict=True)
                  if unit.layer == layer}  # each projection's relative error in its whitened space
        rows.append({"layer": "all" if layer is None else layer, "ppl_ratio": ratio, "seconds": time.perf_counter() - start,
                     "errors": errors})
        print(f"layer {rows[-1]['layer']}: x{ratio:.3f} {' '.join(f'{k} {v:.3f}' for k, v in errors.items())}", flush=True)
    if args.restream:
        stats = restreamed_statistics(result.model, setup, args.calib_tokens)
        plan = plan_head_tensor(setup.anatomy, args.method, args.targets, ratio=args.ratio)
        again = operate_loaded(setup.model, setup.family, stats, plan, setup.seq_len)
        restreamed = setup.ppl(again.model) / original
        print(f"every layer, refitted on the compressed stream: x{restreamed:.3f}", flush=True)
    product = math.prod(r["ppl_ratio"] for r in rows[:-1]) if len(rows) > 1 else None
    print(f"original ppl {original:.3f}; product of one-layer ratios {product}; every layer x{rows[-1]['ppl_ratio']:.3f}")
    write_result(f"layer_sensitivity_{args.model}_{args.method}",
                 {"model": args.model, "method": args.method, "ratio": args.ratio, "targets": args.targets,
                  "windows": args.windows, "original_ppl": original, "product_of_one_layer": product, "rows": rows,
                  "restreamed_ppl_ratio": restreamed if args.restream else None})


if __name__ == "__main__":
    main()
