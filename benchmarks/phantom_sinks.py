"""Phantom attention sinks: how often an operated model gives a prompt's early token a sink's activation.

    python benchmarks/phantom_sinks.py CHECKPOINT [CHECKPOINT ...] [--model qwen2.5-coder-0.5b]
                                       [--dataset code-sample] [--windows 64] [--length 32] [--factor 5]

The first token of every prompt carries a massive residual-stream activation (on Qwen2.5-Coder-0.5B layer 2's
MLP lifts it from a norm of about 10 to about 700); the other tokens do not. An operated layer whose output at
an early position looks enough like the first token's can trigger the same MLP there. Scores the original and
each checkpoint on the same WINDOWS windows of LENGTH tokens from the start of a built-in text's eval part and
prints, per checkpoint, the largest share over the layers of windows whose position 1 (and positions 2-3) has a
residual stream more than FACTOR times the original's norm, and the median relative error of the last layer's
stream at position 1 and at positions 4 on. Writes benchmarks/results/phantom_sinks.json.
"""

from __future__ import annotations

import argparse

import torch

from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from common import write_result
from position_profile import windows_of


@torch.no_grad()
def streams(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream after each decoder layer, [windows, length, hidden] each."""
    return list(model(input_ids=windows, output_hidden_states=True).hidden_states[1:])


def phantom_rows(original: list[torch.Tensor], operated: list[torch.Tensor], factor: float) -> list[dict]:
    rows = []
    for layer, (a, b) in enumerate(zip(original, operated, strict=True)):
        norm, grown = a.norm(dim=-1), b.norm(dim=-1)
        error = (b - a).norm(dim=-1) / norm
        rows.append({"layer": layer, "phantom_1": float((grown[:, 1] > factor * norm[:, 1]).float().mean()),
                     "phantom_2_3": float((grown[:, 2:4] > factor * norm[:, 2:4]).float().mean()),
                     "error_0": float(error[:, 0].median()), "error_1": float(error[:, 1].median()),
                     "error_later": float(error[:, 4:].median())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dataset", default="code-sample")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--factor", type=float, default=5.0)
    args = parser.parse_args()

    source = resolve_source(args.model)
    windows = windows_of(load_tokenizer(source), args.windows, args.length, args.dataset)
    original = streams(load_model(source, torch.float32), windows)
    results = []
    print("| checkpoint | windows with a phantom sink at position 1 (at 2-3) | median stream error at position 1 / 4+ |")
    print("|---|---|---|")
    for path in args.checkpoints:
        rows = phantom_rows(original, streams(load_model(resolve_source(path), torch.float32), windows), args.factor)
        worst = max(rows, key=lambda row: row["phantom_1"])
        print(f"| {path} | {worst['phantom_1']:.3f} ({worst['phantom_2_3']:.3f}) after layer {worst['layer']} "
              f"| {rows[-1]['error_1']:.3f} / {rows[-1]['error_later']:.3f} |")
        results.append({"checkpoint": path, "layers": rows})
    write_result("phantom_sinks", {"settings": vars(args), "rows": results})


if __name__ == "__main__":
    main()
