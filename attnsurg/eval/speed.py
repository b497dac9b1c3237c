"""``attnsurg eval speed``: prefill and decode throughput, the KV cache a model really holds, and peak
memory, every model on the same random token ids, medians over repetitions after a warm-up.

- Prefill: one forward over ``batch`` sequences of ``context`` tokens building the cache; tokens/s =
  batch x context / seconds.
- Decode: ``new_tokens`` greedy steps on that cache, one token per sequence each; tokens/s = batch x new
  tokens / seconds.
- KV cache: the bytes of every tensor the cache object holds after decoding, divided by the tokens in it
  (what the layout really stores, not what the config predicts; the prediction is printed beside it).
- Runtimes: a DeepseekV3 model is timed in each runtime asked for (``attnsurg``: attention over the cached
  latent, ``modeling.absorbed``; ``stock``: transformers' own); a model the runtime does not change, once.
- Peak memory: CUDA's peak allocation, or on Linux CPUs the process's peak resident set (VmHWM), reset
  before each measurement, so it includes the weights.
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnsurg import ui
from attnsurg.errors import UserError
from attnsurg.eval.loading import Loaded, check_models, load_weights, prepare_for_eval
from attnsurg.eval.tasks.scoring import cached_forward, returned_cache
from attnsurg.modeling.absorbed import runtime_applies, use_runtime
from attnsurg.requests import ModelRef, SpeedEval

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")


@dataclass
class ContextSpeed:
    context: int
    prefill_tokens_per_second: float
    decode_tokens_per_second: float
    prefill_seconds: list[float]
    decode_seconds: list[float]
    kv_cache_bytes: int
    kv_bytes_per_token: float
    peak_memory_bytes: int | None


@dataclass
class ModelSpeed:
    model: str
    runtime: str | None  # None: the runtime changes nothing in this model
    model_type: str
    dtype: str
    device: str
    predicted_kv_bytes_per_token: int
    contexts: list[ContextSpeed] = field(default_factory=list)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class SpeedReport:
    contexts: list[int]
    new_tokens: int
    repeats: int
    batch: int
    models: list[ModelSpeed] = field(default_factory=list)
    memory_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tensors_in(obj, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every distinct tensor reachable from a cache object (its layers, lists, dicts and attributes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("transformers", "attnsurg")):
        children = list(vars(obj).values())
    else:
        return []
    return [t for child in children for t in tensors_in(child, seen)]


def cache_bytes(cache) -> int:
    storages = {}
    for tensor in tensors_in(cache):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def reset_peak_memory(device: torch.device) -> bool:
    """Start a fresh peak; False where that is impossible (the figure would be the process's lifetime peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        CLEAR_REFS.write_text("5")  # resets VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


def peak_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if STATUS.exists():
        found = re.search(r"VmHWM:\s+(\d+) kB", STATUS.read_text())
        return int(found.group(1)) * 1024 if found else None
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill_and_decode(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float, object]:
    """Seconds of the prefill, seconds of ``new_tokens`` greedy steps, and the cache at the end."""
    device = ids.device
    synchronize(device)
    start = time.perf_counter()
    out = cached_forward(model, ids)
    synchronize(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = cached_forward(model, out.logits[:, -1:].argmax(-1), out)
    synchronize(device)
    return prefill, time.perf_counter() - start, returned_cache(out)


def measure_context(loaded: Loaded, context: int, request: SpeedEval) -> ContextSpeed:
    generator = torch.Generator().manual_seed(request.seed)
    vocab = loaded.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (request.batch, context), generator=generator).to(loaded.device)
    prefills, decodes = [], []
    peak = None
    for repeat in range(request.warmup + request.repeats):
        gc.collect()
        fresh_peak = reset_peak_memory(loaded.device)
        prefill, decode, cache = prefill_and_decode(loaded.model, ids, request.new_tokens)
        if repeat >= request.warmup:
            prefills.append(prefill)
            decodes.append(decode)
            if fresh_peak:
                peak = max(peak or 0, peak_memory(loaded.device) or 0) or None
            held = cache_bytes(cache)
        del cache
    tokens = request.batch * (context + request.new_tokens)
    decoded = request.batch * request.new_tokens
    return ContextSpeed(
        context=context,
        prefill_tokens_per_second=request.batch * context / statistics.median(prefills),
        decode_tokens_per_second=decoded / statistics.median(decodes) if decoded else float("nan"),
        prefill_seconds=prefills,
        decode_seconds=decodes,
        kv_cache_bytes=held,
        kv_bytes_per_token=held / tokens,
        peak_memory_bytes=peak,
    )


def time_model(loaded: Loaded, runtime: str | None, request: SpeedEval) -> ModelSpeed:
    record = ModelSpeed(loaded.ref.ref, runtime, loaded.anatomy.model_type, loaded.dtype_name, str(loaded.device),
                        loaded.anatomy.kv_bytes_per_token(loaded.dtype_name))
    label = loaded.ref.ref + (f" ({runtime})" if runtime else "")
    with ui.progress_bar(f"Timing {label}", total=len(request.contexts), unit="contexts") as advance:
        for context in request.contexts:
            record.contexts.append(measure_context(loaded, context, request))
            advance(1)
    return record


def check_contexts(request: SpeedEval, ref: ModelRef, config) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    too_long = [c for c in request.contexts if limit and c + request.new_tokens > limit]
    if too_long:
        raise UserError(f"context {too_long[0]} + {request.new_tokens} new tokens is beyond '{ref.ref}' "
                        f"({limit} positions); use --context up to {limit - request.new_tokens}")


def add_ratios(report: SpeedReport) -> None:
    reference = {c.context: c for c in report.models[0].contexts}
    for model in report.models:
        for c in model.contexts:
            first = reference[c.context]
            model.ratios[str(c.context)] = {
                "prefill": c.prefill_tokens_per_second / first.prefill_tokens_per_second,
                "decode": c.decode_tokens_per_second / first.decode_tokens_per_second,
                "kv_cache": c.kv_cache_bytes / first.kv_cache_bytes if first.kv_cache_bytes else float("nan"),
            }


def run_speed(request: SpeedEval) -> SpeedReport:
    check_models(request.models, lambda ref, config: check_contexts(request, ref, config))
    report = SpeedReport(contexts=list(request.contexts), new_tokens=request.new_tokens, repeats=request.repeats,
                         batch=request.batch)
    for ref in request.models:
        loaded = prepare_for_eval(ref, request.device, request.dtype)
        load_weights(loaded)
        runtimes = request.runtimes if runtime_applies(loaded.model) else [None]
        for runtime in runtimes:
            if runtime is not None:
                use_runtime(loaded.model, runtime)
            report.models.append(time_model(loaded, runtime, request))
        del loaded
        gc.collect()
    add_ratios(report)
    device = torch.device(report.models[0].device)
    report.memory_note = ("peak CUDA allocation" if device.type == "cuda" else
                          "peak resident set of the process (VmHWM), weights included")
    return report
