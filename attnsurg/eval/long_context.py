"""A surgery's long-context check, source against result at one length (``--eval-long N``): retrieval of one
multikey haystack (16 needles, each asked in turn: ``tasks.retrieval``) and the perplexity of the last band of
positions of one window of the haystack text's eval part (``perplexity.position_bands``). Short enough to
print beside the six domains; ``benchmarks/long_context.py`` is the full measure (80 questions a length)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnsurg.errors import UserError
from attnsurg.eval.perplexity import band_name, eval_windows, position_bands, score_windows
from attnsurg.eval.tasks.retrieval import HAYSTACK, NEEDLES, retrieval_items, score_retrieval
from attnsurg.eval.tasks.scoring import grouped_queries_in_sdpa, model_device
from attnsurg.requests import TextData


@dataclass(frozen=True)
class LongContextScore:
    length: int  # tokens: the haystack with its question and answer, and the perplexity window
    hits: list[float]  # each question's credit
    band: str  # the last band of positions, e.g. "4K-8K"
    late_ppl: float

    @property
    def rate(self) -> float:
        return sum(self.hits) / len(self.hits)


def check_long_context(length: int, max_positions: int | None) -> None:
    if length and max_positions and length > max_positions:
        raise UserError(f"--eval-long {length} is beyond the model's context ({max_positions} positions); "
                        f"use at most {max_positions}")


@torch.inference_mode()
def long_context_score(model, tokenizer, length: int, label: str) -> LongContextScore:
    """Retrieval and late-position perplexity of one model at ``length`` tokens."""
    device = model_device(model)
    haystacks = retrieval_items(tokenizer, [length], ["multikey"], NEEDLES)
    tokens, windows = eval_windows(tokenizer, TextData(dataset=HAYSTACK, part="eval"), length, length)
    if windows[0].length < length:
        raise UserError(f"--eval-long {length}: the eval part of {HAYSTACK} holds only {windows[0].length} "
                        "tokens; use a shorter length")
    bands = position_bands(length)
    with grouped_queries_in_sdpa(device):
        hits = score_retrieval(model, tokenizer, haystacks).items["acc"]
        score = score_windows(model, tokens.ids, windows[:1], 1, device, f"{label} at {length} tokens", bands)
    late = band_name(*bands[-1])
    nll, count = score.by_position[late]
    return LongContextScore(length, hits, late, math.exp(nll / count))


def long_context_line(before: LongContextScore, after: LongContextScore) -> str:
    """One line: retrieval hits and the last band's perplexity, before -> after, with the share kept."""
    kept = [a for b, a in zip(before.hits, after.hits, strict=True) if b == 1.0]
    share = f"{sum(kept) / len(kept):.2f} of the source's hits kept" if kept else "the source found none"
    return (f"long context, {before.length:,} tokens: retrieval {sum(before.hits):.0f}/{len(before.hits)} -> "
            f"{sum(after.hits):.0f}/{len(after.hits)} ({share}); ppl at positions {before.band} "
            f"{before.late_ppl:.3f} -> {after.late_ppl:.3f} (x{after.late_ppl / before.late_ppl:.3f})")
