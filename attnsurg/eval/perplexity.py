"""Perplexity of one or more models on the same token windows.

Token perplexity is ``exp(sum NLL / scored tokens)``. When the raw text is known, word perplexity and
bits per byte follow lm-eval's definitions over the text the scored tokens cover:
``word_ppl = exp(NLL / words)``, ``byte_ppl = exp(NLL / bytes)``, ``bits_per_byte = NLL / (bytes ln 2)``.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, set_seed

from attnsurg import ui
from attnsurg.arch import inspect_config
from attnsurg.data import Text, load_text
from attnsurg.errors import UserError
from attnsurg.eval.tasks.scoring import keeps_logits
from attnsurg.eval.windows import Window, count_words, plan_windows, scored_text
from attnsurg.eval.loading import check_models, load_weights, prepare_for_eval
from attnsurg.requests import ModelRef, PerplexityEval, TextData


@dataclass(frozen=True)
class Tokens:
    """A tokenized text: ids, each token's end offset in characters (None without a fast tokenizer), and a
    fingerprint of the ids, equal for two models exactly when they see the same tokens."""

    ids: torch.Tensor
    ends: list[int] | None
    fingerprint: str


@dataclass
class Score:
    nll: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    tokens_fed: int = 0
    by_position: dict[str, list[float]] = field(default_factory=dict)  # band -> [summed nll, tokens]

    def add_positions(self, losses: torch.Tensor, positions: torch.Tensor, bands: list[tuple[int, int]]) -> None:
        for low, high in bands:
            inside = (positions >= low) & (positions < high)
            entry = self.by_position.setdefault(band_name(low, high), [0.0, 0])
            entry[0] += float(losses[inside].sum())
            entry[1] += int(inside.sum())

    def position_ppl(self) -> dict[str, float]:
        return {band: math.exp(nll / count) for band, (nll, count) in self.by_position.items() if count}


def position_bands(max_length: int) -> list[tuple[int, int]]:
    """The bands of positions a window's tokens are pooled in: 0-512, 512-1K, 1K-2K, 2K-4K, ... to its end."""
    edges, edge = [0], 512
    while edge < max_length:
        edges.append(edge)
        edge *= 2
    return list(zip(edges, edges[1:] + [max_length]))


def band_name(low: int, high: int) -> str:
    def short(n: int) -> str:
        return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)

    return f"{short(low)}-{short(high)}"


@dataclass
class ModelResult:
    model: str
    text: str
    model_type: str
    dtype: str
    device: str
    windows: int
    tokens_scored: int
    nll: float
    ppl: float
    word_ppl: float | None
    byte_ppl: float | None
    bits_per_byte: float | None
    kv_values_per_token: int
    kv_bytes_per_token: int
    parameters: int
    attention_parameters: int
    seconds: float
    tokens_per_second: float
    tokens_fingerprint: str
    ratio: float = 1.0
    ppl_by_position: dict[str, float] | None = None  # --by-position: each band's ppl
    ratio_by_position: dict[str, float] | None = None  # and its ratio to the first model's
    surgery: str | None = None  # the method's settings, for attnsurg checkpoints
    top_k_recall: float | None = None  # Loki: share of the exact top-k keys selected, on the first window


@dataclass
class PerplexityReport:
    """One row per model and text (model-major); ``ratios`` and ``worst`` sum up each model across texts."""

    text: str
    part: str
    max_length: int
    stride: int
    max_tokens: int | None
    texts: list[str] = field(default_factory=list)
    results: list[ModelResult] = field(default_factory=list)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    worst: dict[str, str | None] = field(default_factory=dict)  # None for the reference model
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def row(self, model: str, text: str) -> ModelResult:
        return next(r for r in self.results if r.model == model and r.text == text)


PREFIX_CHARS_PER_TOKEN = 16  # more characters than any tokenizer spends on a token of natural text or code
PREFIX_MARGIN_TOKENS = 64  # tokens past the ones kept, so the cut cannot change them


def tokenize(tokenizer, text: str, max_tokens: int | None) -> Tokens:
    """Tokenize without special tokens; keep character offsets when the tokenizer can give them. With
    ``max_tokens``, a prefix of the text is tokenized first (the whole text only when it is too short)."""
    fast = getattr(tokenizer, "is_fast", False)
    encoded = None
    if max_tokens and len(text) > (max_tokens + PREFIX_MARGIN_TOKENS) * PREFIX_CHARS_PER_TOKEN:
        prefix = text[: (max_tokens + PREFIX_MARGIN_TOKENS) * PREFIX_CHARS_PER_TOKEN]
        encoded = tokenizer(prefix, add_special_tokens=False, return_offsets_mapping=fast)
        if len(encoded["input_ids"]) < max_tokens + PREFIX_MARGIN_TOKENS:
            encoded = None
    if encoded is None:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast)
    ids = encoded["input_ids"][:max_tokens] if max_tokens else encoded["input_ids"]
    ends = [end for _, end in encoded["offset_mapping"][: len(ids)]] if fast else None
    ids = torch.tensor(ids, dtype=torch.long)
    return Tokens(ids, ends, hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:12])


def batches(windows: list[Window], batch_size: int) -> list[list[Window]]:
    """Group windows of equal length into batches, keeping their order."""
    groups: list[list[Window]] = []
    for w in windows:
        if groups and len(groups[-1]) < batch_size and groups[-1][0].length == w.length:
            groups[-1].append(w)
        else:
            groups.append([w])
    return groups


@torch.inference_mode()
def score_batch(
    model: PreTrainedModel, ids: torch.Tensor, batch: list[Window], device: torch.device, keep_logits: bool
) -> float:
    """Summed NLL (float64) of the scored tokens of equally long windows."""
    length = batch[0].length
    inputs = torch.stack([ids[w.begin : w.end] for w in batch]).to(device)
    # Logits at position p predict token p+1: scoring [score_from, end) needs logits from score_from-1.
    first_logit = min(w.score_from - w.begin - 1 for w in batch)
    kwargs = {"logits_to_keep": length - first_logit} if keep_logits else {}
    logits = model(input_ids=inputs, use_cache=False, **kwargs).logits
    offset = length - logits.shape[1]
    total = 0.0
    for row, w in enumerate(batch):
        start = w.score_from - w.begin - 1 - offset
        predicted = logits[row, start : length - 1 - offset].float()
        targets = inputs[row, w.score_from - w.begin : length]
        total += F.cross_entropy(predicted, targets, reduction="sum").double().item()
    return total


LONG_WINDOW = 2048  # a window longer than this is read in chunks of it, with the model's cache: logits stay small


@torch.inference_mode()
def window_losses(model: PreTrainedModel, ids: torch.Tensor, window: Window, device: torch.device,
                  chunk: int = LONG_WINDOW) -> tuple[torch.Tensor, torch.Tensor]:
    """Each scored token's NLL (float64) in one window, and its position in the window; the window read ``chunk``
    tokens per forward through the model's cache, so no more than ``chunk`` positions of logits exist at once."""
    from attnsurg.eval.tasks.scoring import cache_argument, grouped_queries_in_sdpa, returned_cache

    inputs = ids[window.begin : window.end].to(device)
    losses, cache = [], None
    for start in range(0, window.length, chunk):
        piece = inputs[start : start + chunk][None]
        past = {} if cache is None else {cache_argument(model): cache}
        with grouped_queries_in_sdpa(torch.device(device)):  # a chunk after the first reads the cache with a mask
            out = model(input_ids=piece, use_cache=window.length > chunk, **past)
        cache = returned_cache(out)
        targets = inputs[start + 1 : start + chunk + 1]
        losses.append(F.cross_entropy(out.logits[0, : len(targets)].float(), targets, reduction="none").double())
        del out
    first = window.score_from - window.begin  # the first scored token's position
    return torch.cat(losses)[first - 1 :], torch.arange(first, window.length)


def score_windows(
    model: PreTrainedModel, ids: torch.Tensor, windows: list[Window], batch_size: int, device: torch.device, label: str,
    bands: list[tuple[int, int]] | None = None,
) -> Score:
    """Summed NLL over the windows: batched, or (long windows, or ``bands`` asked) one window at a time, each
    token's loss pooled in its band of positions too."""
    score = Score()
    one_by_one = bands is not None or windows[0].length > LONG_WINDOW
    groups = [[w] for w in windows] if one_by_one else batches(windows, batch_size)
    keep_logits = keeps_logits(model)
    with ui.progress_bar(f"Scoring {label}", total=len(windows), unit="windows") as advance:
        for batch in groups:
            start = time.perf_counter()
            if one_by_one:
                losses, positions = window_losses(model, ids, batch[0], device)
                score.nll += float(losses.sum())
                if bands is not None:
                    score.add_positions(losses, positions, bands)
            else:
                score.nll += score_batch(model, ids, batch, device, keep_logits)
            if not math.isfinite(score.nll):
                dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
                raise UserError(f"{label} gives log-probabilities that are not finite in {dtype}: its activations "
                                "overflow; score it in float32 (--dtype float32), or check how its weights were made")
            score.seconds += time.perf_counter() - start
            score.tokens += sum(w.scored for w in batch)
            score.tokens_fed += sum(w.length for w in batch)
            advance(len(batch), note=f"ppl {math.exp(score.nll / score.tokens):.3f}")
    return score


def text_measures(text: str, tokens: Tokens, windows: list[Window], nll: float) -> dict[str, float | None]:
    if tokens.ends is None:
        return {"word_ppl": None, "byte_ppl": None, "bits_per_byte": None}
    covered = scored_text(text, tokens.ends, windows)
    words, num_bytes = count_words(covered), len(covered.encode("utf-8"))
    return {
        "word_ppl": math.exp(nll / words) if words else None,
        "byte_ppl": math.exp(nll / num_bytes) if num_bytes else None,
        "bits_per_byte": nll / (num_bytes * math.log(2)) if num_bytes else None,
    }


def check_window_fits(request: PerplexityEval, config, ref: str) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit and request.max_length > limit:
        raise UserError(f"--max-length {request.max_length} is longer than '{ref}' supports ({limit} positions)")


def plan_for(request: PerplexityEval, tokens: Tokens, text: Text) -> list[Window]:
    if len(tokens.ids) < request.max_length:
        raise UserError(
            f"the text '{text.name}' has {len(tokens.ids)} tokens, shorter than one window "
            f"({request.max_length}); use a longer text or a smaller --max-length"
        )
    return plan_windows(len(tokens.ids), request.max_length, request.effective_stride)


@dataclass(frozen=True)
class PreparedText:
    text: Text
    tokens: Tokens
    windows: list[Window]


def prepare_texts(tokenizer, request: PerplexityEval, texts: list[Text]) -> list[PreparedText]:
    prepared = []
    for text in texts:
        tokens = tokenize(tokenizer, text.text, request.max_tokens)
        prepared.append(PreparedText(text, tokens, plan_for(request, tokens, text)))
    return prepared


def evaluate_model(model_ref: ModelRef, request: PerplexityEval, texts: list[Text]) -> list[ModelResult]:
    """Score one model on every text (loaded once); the texts are tokenized and planned before loading."""
    loaded = prepare_for_eval(model_ref, request.device, request.dtype)
    check_window_fits(request, loaded.config, model_ref.ref)
    prepared = prepare_texts(loaded.tokenizer, request, texts)
    load_weights(loaded)
    model, dtype_name, anatomy, config = loaded.model, loaded.dtype_name, loaded.anatomy, loaded.config
    results = []
    for item in prepared:
        label = model_ref.ref if len(prepared) == 1 else f"{model_ref.ref} on {item.text.name}"
        bands = position_bands(request.max_length) if request.by_position else None
        score = score_windows(model, item.tokens.ids, item.windows, request.batch_size, loaded.device, label, bands)
        results.append(ModelResult(
            model=model_ref.ref,
            text=item.text.name,
            model_type=anatomy.model_type,
            dtype=dtype_name,
            device=str(loaded.device),
            windows=len(item.windows),
            tokens_scored=score.tokens,
            nll=score.nll,
            ppl=math.exp(score.nll / score.tokens),
            **text_measures(item.text.text, item.tokens, item.windows, score.nll),
            kv_values_per_token=anatomy.kv_values_per_token,
            kv_bytes_per_token=anatomy.kv_bytes_per_token(dtype_name, request.max_length),
            parameters=anatomy.total_parameters,
            attention_parameters=anatomy.attention_parameters,
            seconds=score.seconds,
            tokens_per_second=score.tokens_fed / score.seconds if score.seconds else float("nan"),
            tokens_fingerprint=item.tokens.fingerprint,
            ppl_by_position=score.position_ppl() if bands else None,
            surgery=surgery_settings(config),
            top_k_recall=loki_recall(model, item.tokens.ids, item.windows[0]),
        ))
    del loaded, model
    gc.collect()
    return results


def surgery_settings(config) -> str | None:
    """One line on what attnsurg did to a checkpoint, from ``config.attnsurg``."""
    record = getattr(config, "attnsurg", None)
    if not record:
        return None
    if record.get("loki"):
        loki = record["loki"]
        top_k = f"{loki['top_k']:g} of each query's context" if isinstance(loki["top_k"], float) else f"{loki['top_k']} keys"
        rank = loki["rank"]
        if isinstance(rank, list):
            rank = f"{min(rank)}-{max(rank)} per layer ({loki['variance']:g} of the key variance)"
        return f"loki: rank {rank} of head dim {inspect_config(config).head_dim}, top-k {top_k}, {loki['basis']} basis"
    return record.get("method")


@torch.inference_mode()
def loki_recall(model: PreTrainedModel, ids: torch.Tensor, window: Window) -> float | None:
    """For a Loki model, the top-k recall on the first evaluation window (None for other models)."""
    from attnsurg.methods.loki import has_loki, top_k_recall

    if not has_loki(model):
        return None
    with ui.status("Measuring top-k recall..."):
        return top_k_recall(model, ids[window.begin : window.end][None])


def eval_windows(tokenizer, data: TextData, max_length: int, max_tokens: int) -> tuple[Tokens, list[Window]]:
    """Tokens and disjoint windows of ``data`` for scoring in-memory models (before/after surgery)."""
    text = load_text(data.dataset, data.text, data.part)
    tokens = tokenize(tokenizer, text.text, max_tokens)
    request = PerplexityEval(models=[ModelRef(ref="in-memory")], data=data, max_length=max_length, max_tokens=max_tokens)
    return tokens, plan_for(request, tokens, text)


def scoring_windows(tokenizer, data: TextData, eval_tokens: int, max_positions: int | None):
    """The first ``eval_tokens`` of the data's eval part (a user's file: its start; of several datasets, the
    first's) in windows of up to 1024."""
    length = min(1024, eval_tokens, max_positions or 1024)
    return eval_windows(tokenizer, data.scored().model_copy(update={"part": "eval"}), length, eval_tokens)


def perplexity_of(model: PreTrainedModel, tokens: Tokens, windows: list[Window], label: str = "in-memory model",
                  device: torch.device | None = None) -> float:
    """Token perplexity of an in-memory model on prepared windows, moved to ``device`` for it (default: where it
    is); ``label`` names it on the progress bar."""
    from attnsurg.io.lazy import OFFLOADED, execution_device
    from attnsurg.placement import on_device

    # An offloaded model (io.lazy.offloaded_model) stays where it is: each large module is read in at its forward.
    with contextlib.nullcontext(model) if hasattr(model, OFFLOADED) else on_device(model, device):
        score = score_windows(model, tokens.ids, windows, 1, execution_device(model), label)
    return math.exp(score.nll / score.tokens)


def run_perplexity(request: PerplexityEval) -> PerplexityReport:
    """Evaluate every model of the request on the same texts and windows, one model in memory at a time."""
    set_seed(request.seed)
    check_models(request.models, lambda ref, config: check_window_fits(request, config, ref.ref))
    texts = [load_text(data.dataset, data.text, data.part) for data in request.texts]
    report = PerplexityReport(
        text=", ".join(t.name for t in texts),
        part=", ".join(sorted({t.part for t in texts})),
        max_length=request.max_length,
        stride=request.effective_stride,
        max_tokens=request.max_tokens,
        texts=[t.name for t in texts],
    )
    for model_ref in request.models:
        report.results.extend(evaluate_model(model_ref, request, texts))
    add_ratios(report)
    fingerprints = {t: {r.tokens_fingerprint for r in report.results if r.text == t} for t in report.texts}
    if any(len(prints) > 1 for prints in fingerprints.values()):
        report.notes.append("models saw different tokens (different tokenizers): compare bits per byte, not token ppl")
    return report


def add_ratios(report: PerplexityReport) -> None:
    """Each row's ppl over the first model's on the same text; per model, the text with the largest ratio."""
    reference = report.results[0].model
    for result in report.results:
        first = report.row(reference, result.text)
        result.ratio = result.ppl / first.ppl
        if result.ppl_by_position is not None:
            result.ratio_by_position = {band: ppl / first.ppl_by_position[band]
                                        for band, ppl in result.ppl_by_position.items()}
        report.ratios.setdefault(result.model, {})[result.text] = result.ratio
    for model, ratios in report.ratios.items():
        report.worst[model] = max(ratios, key=ratios.get) if model != reference else None
