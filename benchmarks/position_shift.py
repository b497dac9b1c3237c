"""Whether a model depends on absolute positions: the same tokens scored with every position id moved by an
offset. Softmax attention with RoPE sees only i - j, so the original's perplexity does not move; a model whose
attention reads absolute positions (feature maps of RoPE'd queries and keys) moves with the offset.

    python benchmarks/position_shift.py MODEL [MODEL ...] [--offsets 0,2000,7000] [--dataset wiki-sample]
        [--length 1024] [--scored 512] [--name NAME]

Scores the last SCORED tokens of the first LENGTH tokens of the dataset's eval part, fp32, one window. Writes
benchmarks/results/position_shift-NAME.json.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from attnsurg.eval.perplexity import eval_windows
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.requests import TextData
from common import record_start, write_result
from window_sinks import numbers


@torch.no_grad()
def shifted_ppl(model, ids: torch.Tensor, offset: int, scored: int) -> float:
    positions = torch.arange(ids.shape[1])[None] + offset
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, :-1]
    return math.exp(F.cross_entropy(logits[-scored:].float(), ids[0, 1:][-scored:]).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="the original first, then checkpoints of it")
    parser.add_argument("--offsets", default="0,2000,7000")
    parser.add_argument("--dataset", default="wiki-sample")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--scored", type=int, default=512)
    parser.add_argument("--name", default="demo")
    args = parser.parse_args()
    record_start()

    tokenizer = load_tokenizer(resolve_source(args.models[0]))
    tokens, _ = eval_windows(tokenizer, TextData(dataset=args.dataset, part="eval"), args.length, args.length)
    ids = tokens.ids[: args.length][None]
    rows = []
    for ref in args.models:
        model = load_model(resolve_source(ref), torch.float32)
        ppl = {offset: shifted_ppl(model, ids, offset, args.scored) for offset in numbers(args.offsets)}
        print(f"{ref}: " + ", ".join(f"offset {o}: ppl {p:.3f}" for o, p in ppl.items()), flush=True)
        rows.append({"model": ref, "ppl": ppl})
    write_result(f"position_shift-{args.name}", {"settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
