"""attnsurg from Python: convert a model with ``attnsurg.convert``, score it with ``attnsurg.evaluate``, load the
result with stock transformers and read the KV cache it really holds.

    python examples/python_api.py                     # the demo model, ~4 minutes on 2 cores
    python examples/python_api.py --model DIR --calib-text FILE --output OUT
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attnsurg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--output", type=Path, default=Path("out/example-python-mla"))
    parser.add_argument("--calib-text", type=Path, default=None, help="a UTF-8 file instead of wiki-sample")
    parser.add_argument("--prompt", default="The capital of France is")
    args = parser.parse_args()

    data = {"text": args.calib_text} if args.calib_text else {"dataset": "wiki-sample"}
    report = attnsurg.convert(args.model, args.output, to="mla", kv_budget=0.5, calibration={"data": data},
                              overwrite=True)
    print(f"ppl {report.ppl_before:.3f} -> {report.ppl_after:.3f}; wrote {report.written}")
    scores = attnsurg.evaluate([args.model, str(args.output)], data=data, max_length=256, max_tokens=1024)
    converted = scores.results[-1]
    print(f"eval perplexity on {converted.text}: {converted.ppl:.3f}, x{converted.ratio:.3f} the original's")

    model = AutoModelForCausalLM.from_pretrained(args.output)  # stock DeepseekV3, no remote code
    tokenizer = AutoTokenizer.from_pretrained(args.output)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    print(repr(tokenizer.decode(out.sequences[0])))
    cache = out.past_key_values
    tokens = out.sequences.shape[1] - 1
    held = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
    print(f"KV cache: {held // tokens} values per token over {len(cache.layers)} layers "
          f"({report.plan.cached_values} per layer; the original held {report.plan.original_values})")


if __name__ == "__main__":
    main()
