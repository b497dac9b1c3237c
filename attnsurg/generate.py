"""Loading a model to generate with, and ``attnsurg generate``: one prompt, tokens streamed as they come.

A model loads through the same checks as every command (no pickle, no remote code unless asked) and, in the
attnsurg runtime (the default), its DeepseekV3 attention attends over the cached latent
(``modeling.absorbed``); other models are left as transformers builds them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, TextStreamer

from attnsurg.errors import UserError
from attnsurg.eval.loading import load_weights, prepare_for_eval
from attnsurg.eval.speed import cache_bytes
from attnsurg.modeling.absorbed import use_runtime
from attnsurg.requests import GenerateRequest, ModelRef, Runtime


def load(model: str | ModelRef, *, runtime: Runtime = "attnsurg", device: str = "auto", dtype: str = "auto",
         trust_remote_code: bool = False, allow_pickle: bool = False) -> tuple[PreTrainedModel, Any]:
    """A model ready to generate and its tokenizer, from anything the commands take (a checkpoint directory,
    a ``.gguf`` file, a hub id, a built-in name)."""
    ref = model if isinstance(model, ModelRef) else ModelRef(ref=model, trust_remote_code=trust_remote_code,
                                                            allow_pickle=allow_pickle)
    loaded = prepare_for_eval(ref, device, dtype)
    load_weights(loaded)
    use_runtime(loaded.model, runtime)
    return loaded.model, loaded.tokenizer


@dataclass
class GenerationReport:
    model: str
    runtime: str
    prompt_tokens: int
    new_tokens: int
    text: str
    stopped: str  # "end of text" or "max new tokens"
    prefill_seconds: float  # the prompt's forward and the first new token
    decode_tokens_per_second: float  # the tokens after the first
    kv_cache_bytes: int
    kv_bytes_per_token: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids, through the chat template (as one user turn) when asked and the tokenizer has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def check_length(ref: str, prompt_tokens: int, new_tokens: int, limit: int | None) -> None:
    if limit and prompt_tokens + new_tokens > limit:
        room = limit - prompt_tokens
        fix = f"use --max-new-tokens up to {room}" if room > 0 else "shorten the prompt"
        raise UserError(f"the prompt ({prompt_tokens} tokens) + {new_tokens} new tokens is beyond '{ref}' "
                        f"({limit} positions); {fix}")


class TimedStreamer(TextStreamer):
    """transformers' streamer, its text handed to a callback, with the time each new token arrived."""

    def __init__(self, tokenizer, on_text: Callable[[str], None]):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.on_text = on_text
        self.arrivals: list[float] = []

    def put(self, value) -> None:
        if not self.next_tokens_are_prompt:
            self.arrivals.append(time.perf_counter())
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.on_text(text)


class FiniteScores(LogitsProcessor):
    """Stops generation at the first step whose logits are not finite (weights that overflow in the dtype):
    one error line instead of text sampled from NaN."""

    def __init__(self, ref: str, dtype: torch.dtype):
        self.ref, self.dtype = ref, str(dtype).removeprefix("torch.")

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(scores).any(dim=-1).all()) or bool(torch.isnan(scores).any()):
            raise UserError(f"'{self.ref}' gives logits that are not finite in {self.dtype}: its activations "
                            "overflow; run it in float32 (--dtype float32), or check how its weights were made")
        return scores


@torch.inference_mode()
def run_generate(request: GenerateRequest, on_text: Callable[[str], None] = lambda text: None) -> GenerationReport:
    loaded = prepare_for_eval(request.model, request.device, request.dtype)
    tokenizer = loaded.tokenizer
    ids = prompt_ids(tokenizer, request.prompt, request.chat)
    check_length(request.model.ref, len(ids), request.max_new_tokens, loaded.max_positions)  # before any weights
    load_weights(loaded)
    model = loaded.model
    use_runtime(model, request.runtime)
    torch.manual_seed(request.seed)
    streamer = TimedStreamer(tokenizer, on_text)
    sampling = ({"do_sample": True, "temperature": request.temperature} if request.temperature > 0 else
                {"do_sample": False, "temperature": None, "top_p": None, "top_k": None})
    inputs = torch.tensor([ids], device=model.device)
    start = time.perf_counter()
    output = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=request.max_new_tokens,
                            streamer=streamer, return_dict_in_generate=True,
                            logits_processor=LogitsProcessorList([FiniteScores(request.model.ref, model.dtype)]),
                            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
    end = time.perf_counter()
    new = output.sequences[0, len(ids):].tolist()
    arrivals = streamer.arrivals or [end]
    decode_seconds = arrivals[-1] - arrivals[0]
    held = cache_bytes(output.past_key_values)
    return GenerationReport(
        model=request.model.ref,
        runtime=request.runtime,
        prompt_tokens=len(ids),
        new_tokens=len(new),
        text=tokenizer.decode(new, skip_special_tokens=True),
        stopped="max new tokens" if len(new) >= request.max_new_tokens else "end of text",
        prefill_seconds=arrivals[0] - start,
        decode_tokens_per_second=(len(new) - 1) / decode_seconds if len(new) > 1 and decode_seconds > 0 else float("nan"),
        kv_cache_bytes=held,
        kv_bytes_per_token=held / max(len(ids) + len(new) - 1, 1),
    )
