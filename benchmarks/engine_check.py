"""llama.cpp against transformers on the same token ids, for the original demo model and its MLA conversion.

    python benchmarks/engine_check.py [--budget 0.25] [--converted DIR] [--contexts 4096,16384] [--new-tokens 64]
                                      [--windows 2] [--window 1024] [--threads 2] [--flash-attn]

Builds llama.cpp once from the pinned llama-cpp-python source distribution on PyPI (pip compiles it with
cmake, CPU only) into $ATTNSURG_CACHE/engines, converts the demo model unless --converted is given, exports
both with `attnsurg export --gguf` (f32), then reports for each model:
- perplexity in transformers and in llama.cpp on the same windows of wiki-sample's eval part (the ids come
  from the Hugging Face tokenizer and go to both engines), their relative difference, and the largest logit
  difference;
- greedy continuations of short prompts in both engines, and how many match token for token;
- prefill and decode tokens/s and the KV cache llama.cpp allocates (read from its log) at each context,
  MLA against the original (llama.cpp attends in the latent space, so the cache holds the latent and RoPE key).
Writes benchmarks/results/engine_check.json. Not part of the test suite: the build takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnsurg.data import load_text
from attnsurg.io.assets import cache_dir
from attnsurg.io.gguf_export import export_gguf
from attnsurg.io.load import resolve_source
from common import write_result

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
WORKER = Path(__file__).with_name("engine_llama_cpp.py")
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "def fibonacci(n):\n",
           "Once upon a time, there was a little", "The largest planet in the solar system is"]
KV_LOG = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB")


def llama_cpp_python() -> Path:
    """The interpreter of a venv holding llama-cpp-python built from its sdist (built once, then reused)."""
    root = cache_dir() / "engines" / LLAMA_CPP_PYTHON.replace("==", "-")
    python = root / "bin" / "python"
    if not (root / ".built").is_file():
        print(f"building {LLAMA_CPP_PYTHON} from source into {root} (several minutes)...", file=sys.stderr)
        venv.create(root, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "--no-binary", "llama-cpp-python", LLAMA_CPP_PYTHON, "numpy"],
                       check=True, env=os.environ | {"CMAKE_ARGS": "-DLLAMA_CURL=OFF", "CMAKE_BUILD_PARALLEL_LEVEL": "2"})
        (root / ".built").touch()
    return python


def worker(python: Path, *args: str) -> tuple[dict, str]:
    done = subprocess.run([str(python), str(WORKER), *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama.cpp worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def eval_windows(tokenizer, count: int, length: int) -> list[list[int]]:
    ids = tokenizer(load_text("wiki-sample", None, "eval").text[:200_000])["input_ids"]
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def nll(logits: np.ndarray, windows: list[list[int]]) -> float:
    """Mean next-token negative log-likelihood over every window (all positions but the first)."""
    total, count = 0.0, 0
    for row, ids in zip(logits, windows):
        log_probs = torch.from_numpy(row[:-1]).double().log_softmax(-1)
        total -= log_probs.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        count += len(ids) - 1
    return total / count


def transformers_side(path: str, windows: list[list[int]], prompts: list[list[int]], new: int):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = np.stack([model(torch.tensor([w])).logits[0].numpy() for w in windows])
        greedy = []
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new,
                                 eos_token_id=None, pad_token_id=0)
            greedy.append(out[0, len(prompt):].tolist())
    return logits, greedy


def measure(name: str, checkpoint: str, python: Path, work: Path, args, windows, prompts) -> dict:
    gguf_path = work / f"{name}.gguf"
    if not gguf_path.is_file():
        export_gguf(checkpoint, gguf_path, dtype="f32")
    ids_file, prompts_file, logits_file = work / "windows.json", work / "prompts.json", work / f"{name}.logits.npy"
    ids_file.write_text(json.dumps(windows))
    prompts_file.write_text(json.dumps(prompts))
    worker(python, "logits", str(gguf_path), str(ids_file), str(logits_file))
    llama_greedy = worker(python, "greedy", str(gguf_path), str(prompts_file), str(args.greedy_tokens))[0]["tokens"]
    hf_logits, hf_greedy = transformers_side(checkpoint, windows, prompts, args.greedy_tokens)
    llama_logits = np.load(logits_file)
    record = {
        "ppl_transformers": float(np.exp(nll(hf_logits, windows))),
        "ppl_llama_cpp": float(np.exp(nll(llama_logits, windows))),
        "max_logit_difference": float(np.abs(hf_logits - llama_logits).max()),
        "greedy_prompts_identical": sum(a == b for a, b in zip(hf_greedy, llama_greedy)),
        "greedy_tokens_identical": sum(x == y for a, b in zip(hf_greedy, llama_greedy) for x, y in zip(a, b)),
        "greedy_tokens": len(prompts) * args.greedy_tokens,
        "speed": {},
    }
    record["ppl_relative_difference"] = record["ppl_llama_cpp"] / record["ppl_transformers"] - 1
    for context in args.contexts:
        result, log = worker(python, "speed", str(gguf_path), str(context), str(args.new_tokens), str(args.threads),
                             *(["fa"] if args.flash_attn else []))
        sizes = KV_LOG.findall(log)
        result["kv_cache_mib"] = float(sizes[-1]) if sizes else None
        record["speed"][context] = result
    return record


def print_table(records: dict, contexts: list[int]) -> None:
    print("| model | ppl transformers | ppl llama.cpp | difference | max logit diff | greedy tokens identical |")
    print("|---|---|---|---|---|---|")
    for name, r in records.items():
        print(f"| {name} | {r['ppl_transformers']:.4f} | {r['ppl_llama_cpp']:.4f} | {100 * r['ppl_relative_difference']:+.3f}% "
              f"| {r['max_logit_difference']:.2e} | {r['greedy_tokens_identical']}/{r['greedy_tokens']} "
              f"({r['greedy_prompts_identical']} prompts) |")
    original, converted = records["original"], records["mla"]
    print("\n| context | KV MiB original | KV MiB MLA | ratio | decode tok/s original | MLA | ratio | prefill tok/s original | MLA | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for context in contexts:
        a, b = original["speed"][context], converted["speed"][context]
        kv = f"x{b['kv_cache_mib'] / a['kv_cache_mib']:.3f}" if a["kv_cache_mib"] and b["kv_cache_mib"] else "-"
        print(f"| {context} | {a['kv_cache_mib']} | {b['kv_cache_mib']} | {kv} "
              f"| {a['decode_tokens_per_s']:.1f} | {b['decode_tokens_per_s']:.1f} | x{b['decode_tokens_per_s'] / a['decode_tokens_per_s']:.2f} "
              f"| {a['prefill_tokens_per_s']:.0f} | {b['prefill_tokens_per_s']:.0f} | x{b['prefill_tokens_per_s'] / a['prefill_tokens_per_s']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original", default="smollm2-135m")
    parser.add_argument("--converted", help="an MLA checkpoint (native format); default: convert the original now")
    parser.add_argument("--budget", type=float, default=0.25, help="KV budget of the conversion made when --converted is not given")
    parser.add_argument("--contexts", default="4096,16384")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--greedy-tokens", type=int, default=24)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash-attn", action="store_true", help="speed runs with llama.cpp's flash attention on")
    parser.add_argument("--work-dir", type=Path, default=Path("out/engine"))
    args = parser.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",") if c]

    python = llama_cpp_python()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    converted = args.converted
    if converted is None:
        converted = str(args.work_dir / f"mla-{args.budget:g}")
        if not Path(converted, "config.json").is_file():
            subprocess.run([str(Path(sys.executable).with_name("attnsurg")), "convert", args.original, "--to", "mla", "--kv-budget",
                            str(args.budget), "-o", converted, "--eval-domains", "none"], check=True)
    original = resolve_source(args.original).path
    tokenizer = AutoTokenizer.from_pretrained(original)
    windows = eval_windows(tokenizer, args.windows, args.window)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with tempfile.TemporaryDirectory(dir=args.work_dir) as scratch:
        work = Path(scratch)
        records = {name: measure(name, path, python, work, args, windows, prompts)
                   for name, path in (("original", original), ("mla", converted))}
    print_table(records, args.contexts)
    write_result("engine_check", {"converted": converted, "settings": vars(args) | {"work_dir": str(args.work_dir)}, "records": records}, default=str)


if __name__ == "__main__":
    main()
