"""What every task shares: multiple-choice items scored by log-likelihood, and per-item results so models
can be compared item by item ("retained")."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnsurg.eval.tasks.scoring import encode_pair, loglikelihoods


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


def multiple_choice(model, tokenizer, items: list[ChoiceItem], max_length: int) -> tuple[list[float], list[float]]:
    """Per item, lm-eval's ``acc`` credit (the choice with the highest summed log-likelihood of its
    continuation) and whether the right continuation is the greedy one (every token the argmax)."""
    requests = [encode_pair(tokenizer, item.context, choice) for item in items for choice in item.choices]
    likelihoods = loglikelihoods(model, requests, max_length)
    credits, greedy, start = [], [], 0
    for item in items:
        scored = likelihoods[start : start + len(item.choices)]
        credits.append(choice_credit([lk.logprob for lk in scored], item.answer))
        greedy.append(1.0 if scored[item.answer].is_greedy else 0.0)
        start += len(item.choices)
    return credits, greedy


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def retained(reference: list[float], other: list[float]) -> float:
    """Of the items the reference gets right, the share the other model still gets right."""
    right = [i for i, credit in enumerate(reference) if credit == 1.0]
    return mean([1.0 if other[i] == 1.0 else 0.0 for i in right]) if right else float("nan")
