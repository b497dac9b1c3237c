"""Throughput of `attnsurg eval perplexity` against a bare forward pass of the same model on the same windows.

    python benchmarks/eval_throughput.py [--model smollm2-135m] [--windows 4] [--max-length 1024] [--repeats 3]

Both sides run in this process on one loaded model, interleaved, on the same token windows: the bare side
is `model(input_ids)` per window, the eval side is the scoring loop `attnsurg eval perplexity` runs (forward
plus the loss of every scored token). The table reports tokens/s of each (best of --repeats) and their
ratio; the end-to-end wall time of the command (load, tokenize, score) is printed beside it.
Writes benchmarks/results/eval_throughput.json.
"""

from __future__ import annotations

import argparse
import time

import torch

from attnsurg.data import load_text
from attnsurg.eval.perplexity import run_perplexity, score_windows, tokenize
from attnsurg.eval.windows import plan_windows
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.requests import ModelRef, PerplexityEval, TextData
from common import write_result


@torch.inference_mode()
def bare_forward_tokens_per_second(model, ids: torch.Tensor, windows) -> float:
    start = time.perf_counter()
    for w in windows:
        model(input_ids=ids[w.begin : w.end][None], use_cache=False).logits.float()
    return sum(w.length for w in windows) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    source = resolve_source(args.model)
    model = load_model(source)
    tokens = tokenize(load_tokenizer(source), load_text("wiki-sample", None, "eval").text, args.windows * args.max_length)
    windows = plan_windows(len(tokens.ids), args.max_length, args.max_length)
    request = PerplexityEval(
        models=[ModelRef(ref=args.model)],
        data=TextData(dataset="wiki-sample"),
        max_length=args.max_length,
        max_tokens=args.windows * args.max_length,
        device="cpu",
    )

    bare, evaluated = [], []
    for _ in range(args.repeats):
        bare.append(bare_forward_tokens_per_second(model, tokens.ids, windows))
        score = score_windows(model, tokens.ids, windows, 1, torch.device("cpu"), args.model)
        evaluated.append(score.tokens_fed / score.seconds)
    start = time.perf_counter()
    run_perplexity(request)
    wall = [time.perf_counter() - start]

    record = {
        "model": args.model,
        "windows": len(windows),
        "max_length": args.max_length,
        "threads": torch.get_num_threads(),
        "bare_forward_tokens_per_s": max(bare),
        "eval_tokens_per_s": max(evaluated),
        "ratio": max(evaluated) / max(bare),
        "eval_wall_s_including_load": min(wall),
    }
    print("| measure | bare forward | attnsurg eval | ratio |")
    print("|---|---|---|---|")
    print(f"| tokens/s ({record['windows']} x {args.max_length}, best of {args.repeats}) | "
          f"{record['bare_forward_tokens_per_s']:.0f} | {record['eval_tokens_per_s']:.0f} | {record['ratio']:.3f} |")
    print(f"\nattnsurg eval end to end (load + tokenize + score): {record['eval_wall_s_including_load']:.1f} s")
    write_result("eval_throughput", record)


if __name__ == "__main__":
    main()
