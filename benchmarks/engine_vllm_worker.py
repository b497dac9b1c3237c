"""One vLLM measurement on one checkpoint, run by benchmarks/engine_vllm.py inside the vLLM venv
(``engine_vllm.vllm_python`` makes it).

    python engine_vllm_worker.py REQUEST.json

REQUEST: {"model": DIR, "dtype": "float32", "prompts": [[ids], ...], "new_tokens": 32, "max_model_len": N,
"custom_ops": ["all", "-rotary_embedding"] or null, "speed": {"context": 4096, "new_tokens": 32} or null}.
Prints one JSON line on stdout: each prompt's greedy tokens and the log-prob vLLM gives each prompt token, the KV
cache blocks it allocated and their size, and, when asked, the seconds of a prefill and of a decode at a depth.
Needs only vllm.
"""

from __future__ import annotations

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def engine(request: dict) -> LLM:
    compilation = {"custom_ops": request["custom_ops"]} if request.get("custom_ops") else None
    return LLM(model=request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"], seed=0,
               enforce_eager=True, compilation_config=compilation, max_num_seqs=4, trust_remote_code=False)


def greedy_and_prompt_logprobs(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, prompt_logprobs=0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens, logprobs = [], []
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens.append(list(output.outputs[0].token_ids))
        # position 0 has no log-prob; each later entry holds the prompt's own token
        logprobs.append([entry[token].logprob for token, entry in zip(prompt[1:], output.prompt_logprobs[1:], strict=True)])
    return {"tokens": tokens, "prompt_logprobs": logprobs}


def timed(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return time.perf_counter() - start


def speed(llm: LLM, vocab: int, context: int, new_tokens: int) -> dict:
    """Seconds for a prompt of ``context`` tokens with one new token and with ``new_tokens``: the difference is
    the decode at that depth."""
    prompt = [(7 * i + 11) % vocab for i in range(context)]
    timed(llm, prompt[:64], 2)  # warm-up
    prefill = timed(llm, prompt, 1)
    total = timed(llm, [t + 1 for t in prompt], new_tokens + 1)  # a new prompt: no prefix-cache hit
    return {"context": context, "prefill_s": prefill, "decode_tokens_per_s": new_tokens / max(total - prefill, 1e-9)}


def kv_cache(llm: LLM) -> dict:
    cache = llm.llm_engine.vllm_config.cache_config
    return {"kv_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    llm = engine(request)
    result = greedy_and_prompt_logprobs(llm, request["prompts"], request["new_tokens"])
    result |= kv_cache(llm)
    if request.get("speed"):
        vocab = llm.llm_engine.model_config.get_vocab_size()
        result["speed"] = speed(llm, vocab, request["speed"]["context"], request["speed"]["new_tokens"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
