"""One llama.cpp measurement on one GGUF, run by benchmarks/engine_check.py inside the llama-cpp-python build.

    python engine_llama_cpp.py logits MODEL.gguf IDS.json OUT.npy     # logits at every position of each window
    python engine_llama_cpp.py greedy MODEL.gguf IDS.json N            # N greedy tokens after each prompt
    python engine_llama_cpp.py speed MODEL.gguf CONTEXT NEW THREADS [fa] # prefill and decode tokens/s at a depth
                                                                         # (fa: llama.cpp's flash attention on)
    python engine_llama_cpp.py profile MODEL.gguf CONTEXT NEW THREADS PERF.data [fa]
                                                  # the same, with Linux perf sampling the decode steps only

Needs only numpy and llama_cpp. Prints one JSON line on stdout; llama.cpp's own log goes to stderr (the
caller reads the KV cache size from it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from llama_cpp import Llama


def load(path: str, n_ctx: int, logits_all: bool, threads: int = 2, verbose: bool = False, flash: bool = False) -> Llama:
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, logits_all=logits_all, n_threads=threads,
                 n_threads_batch=threads, verbose=verbose, seed=0, flash_attn=flash)


def next_token(model: Llama) -> int:
    """The greedy next token from the last evaluated position's logits (read in place, no copy)."""
    return int(np.ctypeslib.as_array(model._ctx.get_logits_ith(-1), shape=(model.n_vocab(),)).argmax())


def window_logits(path: str, windows: list[list[int]], out: str) -> dict:
    model = load(path, max(len(w) for w in windows), logits_all=True)
    logits = []
    for window in windows:
        model.reset()
        model.eval(window)
        logits.append(np.array(model.scores[: len(window)], dtype=np.float32))
    np.save(out, np.stack(logits))
    return {"windows": len(windows)}


def greedy(path: str, prompts: list[list[int]], new: int) -> dict:
    model = load(path, max(len(p) for p in prompts) + new, logits_all=False)
    generated = []
    for prompt in prompts:
        model.reset()
        model.eval(prompt)
        tokens = []
        for _ in range(new):
            token = next_token(model)
            tokens.append(token)
            model.eval([token])
        generated.append(tokens)
    return {"tokens": generated}


def speed(path: str, context: int, new: int, threads: int, flash: bool = False, perf_data: str | None = None) -> dict:
    """Prefill ``context`` random tokens, then decode ``new`` greedy ones; with ``perf_data``, `perf record`
    samples this process (call graphs included) during the decode steps alone."""
    model = load(path, context + new, logits_all=False, threads=threads, verbose=True, flash=flash)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, model.n_vocab() - 100, size=context)]
    start = time.perf_counter()
    model.eval(prompt)
    prefill = time.perf_counter() - start
    recorder = None
    if perf_data is not None:
        recorder = subprocess.Popen(["perf", "record", "-F", "499", "-g", "-p", str(os.getpid()), "-o", perf_data],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attaches before the first decode step
    start = time.perf_counter()
    for _ in range(new):
        model.eval([next_token(model)])
    decode = time.perf_counter() - start
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        recorder.wait()
    return {"prefill_tokens_per_s": context / prefill, "decode_tokens_per_s": new / decode}


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "logits":
        result = window_logits(path, json.loads(open(sys.argv[3]).read()), sys.argv[4])
    elif mode == "greedy":
        result = greedy(path, json.loads(open(sys.argv[3]).read()), int(sys.argv[4]))
    elif mode == "speed":
        result = speed(path, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:] == ["fa"])
    elif mode == "profile":
        result = speed(path, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[7:] == ["fa"], sys.argv[6])
    else:
        sys.exit(f"unknown mode '{mode}': logits, greedy, speed or profile (see the docstring)")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
