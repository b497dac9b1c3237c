"""Scoring a surgery: the texts scored before and after (the calibration text's eval part, then each domain), the
scores, and the card's rows for them."""

from __future__ import annotations


import torch
from transformers import PreTrainedModel

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.eval.perplexity import Tokens, perplexity_of, scoring_windows
from attnsurg.eval.windows import Window
from attnsurg.io.card import CardInfo
from attnsurg.errors import UserError
from attnsurg.pipelines.job import Job
from attnsurg.requests import TextData
from attnsurg.pipelines.processes import is_main_process


def scored_text(calibration: TextData) -> TextData:
    """The text whose eval part is scored first, as "the calibration text": the calibration text itself, or the
    first of several calibration datasets."""
    return calibration.scored()


def domain_texts(calibration: TextData, domains: list[str], eval_tokens: int) -> list[TextData]:
    """The evaluation domains scored besides the calibration text (its own domain is not repeated)."""
    first = scored_text(calibration).dataset
    return [TextData(dataset=d) for d in domains if d != first] if eval_tokens else []


def fetch_domains(texts: list[TextData]) -> None:
    """Fetch the domains' texts before any heavy work, so a missing one fails in seconds."""
    from attnsurg.io.assets import ensure_text

    for data in texts:
        try:
            ensure_text(data.dataset)
        except UserError as exc:
            raise UserError(f"{exc} (evaluation domain {data.dataset}; --eval-domains none, or in a recipe "
                            "eval: {domains: []}, skips them)") from None


def score_domains(source: PreTrainedModel, result: PreTrainedModel, tokenizer, texts: list[TextData], eval_tokens: int,
                  max_positions: int | None, device: torch.device | None = None) -> dict[str, tuple[float, float]]:
    """ppl of the source and of the result on the first ``eval_tokens`` of each domain's eval part."""
    scores = {}
    for data in texts:
        windows = scoring_windows(tokenizer, data, eval_tokens, max_positions)
        scores[data.dataset] = (perplexity_of(source, *windows, f"the source on {data.dataset}", device),
                                perplexity_of(result, *windows, f"the result on {data.dataset}", device))
    return scores


def worst_domain(scores: dict[str, tuple[float, float]]) -> str | None:
    return max(scores, key=lambda d: scores[d][1] / scores[d][0]) if scores else None


def domain_rows(scores: dict[str, tuple[float, float]], eval_tokens: int, before: str = "") -> list[dict[str, str]]:
    """The card's rows for the domains, the worst ratio named in its row (``before``: what the first
    figure is, when not the source model)."""
    worst = worst_domain(scores)
    of = f" of the {before}" if before else ""
    return [perplexity_row(TextData(dataset=d), eval_tokens, first, after,
                           f" (x{after / first:.3f}{of}{', the worst domain' if d == worst and len(scores) > 1 else ''})")
            for d, (first, after) in scores.items()]


ScoredText = tuple[str, Tokens, list[Window]]  # a text's name, its tokens and the windows scored


def scored_texts(tokenizer, job: Job, anatomy: AttentionAnatomy) -> list[ScoredText]:
    """The windows every before/after score uses: the calibration text's eval part first, then each domain's
    (none without eval tokens, or on a process that does not score)."""
    if not job.recipe.eval.tokens or not is_main_process():
        return []
    first = scored_text(job.recipe.calibration.data)
    texts = [first, *domain_texts(job.recipe.calibration.data, job.recipe.eval.domains, job.recipe.eval.tokens)]
    return [(data.dataset or str(data.text), *scoring_windows(tokenizer, data, job.recipe.eval.tokens, anatomy.max_positions))
            for data in texts]


def perplexities(model: PreTrainedModel, texts: list[ScoredText], label: str, device: torch.device | None = None) -> list[float]:
    """The model's token perplexity on each text (the first named ``label`` alone on the progress bar)."""
    return [perplexity_of(model, tokens, windows, label if i == 0 else f"{label} on {name}", device)
            for i, (name, tokens, windows) in enumerate(texts)]


def long_context_of(model: PreTrainedModel, tokenizer, job: Job, label: str, device: torch.device | None = None):
    """The recipe's long-context check of one model (``eval.long_context`` tokens), or None when not asked
    for or on a process that does not score."""
    length = job.recipe.eval.long_context
    if not length or not is_main_process():
        return None
    from attnsurg.eval.long_context import long_context_score
    from attnsurg.placement import on_device

    with on_device(model, device):
        return long_context_score(model, tokenizer, length, label)


def record_scores(report, texts: list[ScoredText], before: list[float], after: list[float]) -> None:
    report.ppl_before, report.ppl_after = before[0], after[0]
    report.domains = {name: (b, a) for (name, _, _), b, a in zip(texts[1:], before[1:], after[1:], strict=True)}


def add_score_rows(info: CardInfo, job: Job, report) -> None:
    """The card's perplexity rows: the calibration text's, then each domain's; then the long-context check's."""
    if report.ppl_before is not None:
        info.figures.append(perplexity_row(scored_text(job.recipe.calibration.data), job.recipe.eval.tokens,
                                           report.ppl_before, report.ppl_after,
                                           f" (x{report.ppl_after / report.ppl_before:.3f}, the calibration text)"))
        info.figures.extend(domain_rows(report.domains, job.recipe.eval.tokens))
    if report.long_context is not None:
        before, after = report.long_context
        length = job.recipe.eval.long_context
        info.figures.append({"metric": f"retrieval at {length} tokens (multikey, {len(before.hits)} questions)",
                             "before": f"{before.rate:.3f}", "after": f"{after.rate:.3f}"})
        info.figures.append({"metric": f"ppl at positions {before.band} of one {length}-token window",
                             "before": f"{before.late_ppl:.3f}", "after": f"{after.late_ppl:.3f}"})


def perplexity_row(data: TextData, eval_tokens: int, before: float, after: float, note: str = "") -> dict[str, str]:
    """The card's before/after perplexity row."""
    name = data.dataset or str(data.text)
    return {"metric": f"ppl, {name} eval part, first {eval_tokens} tokens{note}", "before": f"{before:.3f}", "after": f"{after:.3f}"}
