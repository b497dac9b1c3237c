"""Short-context check: greedy continuations of one-line factual prompts, original and checkpoints side by side.

    python benchmarks/short_prompts.py CHECKPOINT [CHECKPOINT ...] [--model smollm2-135m] [--new-tokens 6]

Perplexity on 1024-token windows weighs the first few positions of a window by a few per mille; a model can
score better there and still lose what it knew at position 5. Each prompt has the answer the original gives;
a continuation counts when it contains it as a word. Prints every continuation and each model's count, fp32, greedy.
"""

from __future__ import annotations

import argparse
import re

import torch

from attnsurg.io.load import load_model, load_tokenizer, resolve_source

# (prompt, the answer the demo model gives greedily)
PROMPTS = [
    ("The capital of France is", "Paris"),
    ("The capital of Germany is", "Berlin"),
    ("The largest planet in the solar system is", "Jupiter"),
    ("The capital of Japan is", "Tokyo"),
    ("The chemical symbol for gold is", "Au"),
    ("Albert Einstein was born in", "1879"),
]


@torch.no_grad()
def continuations(model, tokenizer, new_tokens: int) -> list[str]:
    texts = []
    for prompt, _ in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
        texts.append(tokenizer.decode(out[0, ids.input_ids.shape[1]:]))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=6)
    args = parser.parse_args()

    source = resolve_source(args.model)
    tokenizer = load_tokenizer(source)
    names = ["original"] + args.checkpoints
    sources = [source] + [resolve_source(path) for path in args.checkpoints]
    texts = {name: continuations(load_model(src, torch.float32), tokenizer, args.new_tokens)
             for name, src in zip(names, sources)}

    print("| prompt | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for i, (prompt, _) in enumerate(PROMPTS):
        print(f"| {prompt} | " + " | ".join(repr(texts[n][i]) for n in names) + " |")
    hits = {n: sum(bool(re.search(rf"\b{re.escape(answer)}\b", texts[n][i])) for i, (_, answer) in enumerate(PROMPTS))
            for n in names}
    print("| answers kept | " + " | ".join(f"{hits[n]} / {len(PROMPTS)}" for n in names) + " |")


if __name__ == "__main__":
    main()
