"""`attnsurg eval perplexity` of MLA checkpoints in the attnsurg runtime (what the command uses) against
transformers' stock DeepseekV3 attention: the same perplexity, and the scoring speed of each.

    python benchmarks/eval_runtime.py MLA [MLA ...] [--dataset wiki-sample] [--max-tokens 4096]

Writes benchmarks/results/eval_runtime.json and prints, per model, the perplexity and tokens/s in each runtime.
"""

from __future__ import annotations

import argparse
from unittest import mock

import attnsurg.eval.loading as loading
from attnsurg.eval.perplexity import run_perplexity
from attnsurg.requests import ModelRef, PerplexityEval, TextData
from common import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--dataset", default="wiki-sample")
    parser.add_argument("--max-tokens", type=int, default=4096)
    args = parser.parse_args()
    request = PerplexityEval(models=[ModelRef(ref=m) for m in args.models], data=TextData(dataset=args.dataset),
                             max_tokens=args.max_tokens, device="cpu")
    absorbed = run_perplexity(request)
    switch = loading.use_runtime
    with mock.patch.object(loading, "use_runtime", lambda model, runtime: switch(model, "stock")):
        stock = run_perplexity(request)
    print("| model | ppl attnsurg | ppl stock | relative difference | tok/s attnsurg | tok/s stock | ratio |")
    print("|---|---|---|---|---|---|---|")
    for a, s in zip(absorbed.results, stock.results, strict=True):
        print(f"| {a.model} | {a.ppl:.4f} | {s.ppl:.4f} | {a.ppl / s.ppl - 1:+.1e} | {a.tokens_per_second:.0f} | "
              f"{s.tokens_per_second:.0f} | x{a.tokens_per_second / s.tokens_per_second:.2f} |")
    print(write_result("eval_runtime", {"request": request.model_dump(mode="json"),
                                        "attnsurg": [r.__dict__ for r in absorbed.results],
                                        "stock": [r.__dict__ for r in stock.results]}))


if __name__ == "__main__":
    main()
