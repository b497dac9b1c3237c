"""Decoding from a cached k/v latent (`compress --kv-latent`): one-token steps that mix the latent before the
value rows, against rebuilding K and V from it at every step, with the original timed in the same run.

    python benchmarks/kv_latent_decode.py ORIGINAL KV_LATENT [--contexts 1024,4096,8160] [--new-tokens 32]
        [--repeats 1] [--name kv_latent_decode]

Writes benchmarks/results/NAME.json (both speed reports and their provenance) and prints decode tokens/s and
the ratio to the original per context for each path.
"""

from __future__ import annotations

import argparse
from unittest import mock

from attnsurg.eval.speed import run_speed
from attnsurg.modeling.modeling_attnsurg import LatentKVAttention, RebuiltKVAttention
from attnsurg.requests import ModelRef, SpeedEval
from common import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("original")
    parser.add_argument("kv_latent")
    parser.add_argument("--contexts", default="1024,4096,8160")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--name", default="kv_latent_decode")
    args = parser.parse_args()
    request = SpeedEval(models=[ModelRef(ref=args.original), ModelRef(ref=args.kv_latent)],
                        contexts=[int(c) for c in args.contexts.split(",")], new_tokens=args.new_tokens,
                        repeats=args.repeats, warmup=0)
    mixed = run_speed(request)
    with mock.patch.object(LatentKVAttention, "forward", RebuiltKVAttention.forward):
        rebuilt = run_speed(request)
    print("| context | original decode tok/s | latent mixed | x original | K and V rebuilt | x original |")
    print("|---|---|---|---|---|---|")
    for context in request.contexts:
        first = next(c for c in mixed.models[0].contexts if c.context == context)
        row = [f"{first.decode_tokens_per_second:.1f}"]
        for report in (mixed, rebuilt):
            speed = next(c for c in report.models[1].contexts if c.context == context).decode_tokens_per_second
            row += [f"{speed:.1f}", f"x{report.models[1].ratios[str(context)]['decode']:.2f}"]
        print(f"| {context} | " + " | ".join(row) + " |")
    print(write_result(args.name, {"request": request.model_dump(mode="json"), "mixed": mixed.to_dict(),
                                   "rebuilt": rebuilt.to_dict()}))


if __name__ == "__main__":
    main()
