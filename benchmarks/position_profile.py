"""Where in the window an operated model loses: ppl ratio to the original by token position, in one run.

    python benchmarks/position_profile.py CHECKPOINT [CHECKPOINT ...] [--model smollm2-135m] [--windows 4]
                                          [--length 1024] [--bands 0 128 512 768 1024] [--dataset wiki-sample]

Scores the original and each checkpoint on the same WINDOWS disjoint windows of LENGTH tokens from the start
of a built-in text's eval part (fp32), and prints, per band of positions, the original's ppl and each
checkpoint's ratio to it. An attention approximation fitted on short windows shows up here as a ratio that
grows with position. Writes benchmarks/results/position_profile.json.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from attnsurg.eval.perplexity import eval_windows
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.requests import TextData
from common import write_result


def windows_of(tokenizer, count: int, length: int, dataset: str = "wiki-sample") -> torch.Tensor:
    """The windows ``perplexity_of`` scores for the same count and length: the start of the eval part."""
    tokens, _ = eval_windows(tokenizer, TextData(dataset=dataset, part="eval"), length, count * length)
    if len(tokens.ids) < count * length:
        raise SystemExit(f"the eval part has {len(tokens.ids)} tokens, fewer than {count} x {length}")
    return tokens.ids[: count * length].view(count, length)


@torch.no_grad()
def token_nll(model, windows: torch.Tensor) -> torch.Tensor:
    """[windows, length - 1]: the loss of predicting token t + 1 at position t."""
    rows = []
    for window in windows:
        logits = model(input_ids=window[None]).logits[0, :-1].float()
        rows.append(F.cross_entropy(logits, window[1:], reduction="none"))
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--bands", type=int, nargs="+", default=[0, 128, 512, 768, 1024])
    parser.add_argument("--dataset", default="wiki-sample")
    args = parser.parse_args()

    source = resolve_source(args.model)
    tokenizer = load_tokenizer(source)
    windows = windows_of(tokenizer, args.windows, args.length, args.dataset)
    original = token_nll(load_model(source, torch.float32), windows)
    bands = list(zip(args.bands[:-1], args.bands[1:]))
    rows = []
    for path in args.checkpoints:
        nll = token_nll(load_model(resolve_source(path), torch.float32), windows)
        rows.append({"checkpoint": path, "ratio": [float((nll[:, a:b].mean() - original[:, a:b].mean()).exp()) for a, b in bands],
                     "overall": float((nll.mean() - original.mean()).exp())})

    print("| positions | " + " | ".join(f"{a}-{b - 1}" for a, b in bands) + " | all |")
    print("|---" * (len(bands) + 2) + "|")
    print("| original ppl | " + " | ".join(f"{original[:, a:b].mean().exp():.2f}" for a, b in bands)
          + f" | {original.mean().exp():.2f} |")
    for row in rows:
        print(f"| {row['checkpoint']} | " + " | ".join(f"x{r:.3f}" for r in row["ratio"]) + f" | x{row['overall']:.3f} |")
    write_result("position_profile", {"settings": vars(args), "bands": bands, "rows": rows})


if __name__ == "__main__":
    main()
