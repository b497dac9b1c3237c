"""What every task shares: multiple-choice items scored by log-likelihood, generation items scored by
greedy exact match, and per-item results so models can be compared item by item ("retained")."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from attnsurg.eval.tasks.scoring import encode, encode_pair, greedy_generate, loglikelihoods


@dataclass(frozen=True)
class ChoiceItem:
    """A prompt, its candidate continuations and the index of the right one."""

    id: str
    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass
class TaskResult:
    """Aggregate metrics of one task on one model, and each item's credit per metric (1 right, 0 wrong,
    a share where a tie leaves it open) for the retained figures."""

    task: str
    metrics: dict[str, float]
    items: dict[str, list[float]] = field(default_factory=dict)
    details: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0


def choice_credit(scores: list[float], answer: int) -> float:
    """1 if the answer alone scores highest; with a tie at the top, the chance that a random pick among
    the tied is the answer (so a model that cannot tell the choices apart scores chance, not 100%)."""
    best = max(scores)
    tied = [i for i, s in enumerate(scores) if s == best]
    return 1.0 / len(tied) if answer in tied else 0.0


def multiple_choice(model, tokenizer, items: list[ChoiceItem], max_length: int) -> list[float]:
    """lm-eval ``acc``: the choice with the highest summed log-likelihood of its continuation."""
    requests = [encode_pair(tokenizer, item.context, choice) for item in items for choice in item.choices]
    likelihoods = loglikelihoods(model, requests, max_length)
    credits, start = [], 0
    for item in items:
        scores = [lk.logprob for lk in likelihoods[start : start + len(item.choices)]]
        credits.append(choice_credit(scores, item.answer))
        start += len(item.choices)
    return credits


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def starts_with_answer(generated: str, answer: str) -> bool:
    """Whole-word match: the generated text's first words are the answer's words (case and punctuation
    ignored), so "Paris, the capital" matches "Paris" and "Parisian" does not."""
    expected = words(answer)
    return bool(expected) and words(generated)[: len(expected)] == expected


def greedy_match(model, tokenizer, prompt: str, answer: str, max_new_tokens: int) -> tuple[bool, str]:
    generated = tokenizer.decode(greedy_generate(model, encode(tokenizer, prompt), max_new_tokens, stop_ids(tokenizer)))
    first_line = generated.strip().split("\n")[0]
    return starts_with_answer(first_line, answer), first_line


def stop_ids(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def retained(reference: list[float], other: list[float]) -> float:
    """Of the items the reference gets right, the share the other model still gets right."""
    right = [i for i, credit in enumerate(reference) if credit == 1.0]
    return mean([1.0 if other[i] == 1.0 else 0.0 for i in right]) if right else float("nan")
