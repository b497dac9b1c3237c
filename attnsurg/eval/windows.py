"""Token windows for perplexity, and the text their scored tokens cover.

Disjoint windows (stride = window) are the GPTQ / TransMLA convention; a smaller stride is the
Hugging Face guide's sliding window, where each window scores only the tokens the previous one did not
(its overlap serves as context). A token is scored when a window holds it and at least one token before
it, so the first token of the text (and, for disjoint windows, of every window) is context only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` are fed to the model; tokens ``[score_from, end)`` are scored."""

    begin: int
    end: int
    score_from: int

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def scored(self) -> int:
        return self.end - self.score_from


def plan_windows(num_tokens: int, max_length: int, stride: int) -> list[Window]:
    windows: list[Window] = []
    previous_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        score_from = max(previous_end, begin + 1)
        if score_from < end:
            windows.append(Window(begin, end, score_from))
        previous_end = end
        if end == num_tokens:
            break
    return windows


def scored_positions(windows: list[Window]) -> list[int]:
    return [i for w in windows for i in range(w.score_from, w.end)]


def scored_text(text: str, token_ends: list[int], windows: list[Window]) -> str:
    """The characters the scored tokens stand for.

    Token i covers ``text[end(i-1):end(i)]`` (end offsets are monotone for any fast tokenizer, and this
    assignment keeps whitespace that offset trimming would drop). Discontiguous runs are joined by a space
    so words on either side of a gap are not merged.
    """
    runs: list[list[int]] = []  # [first scored token, end token) of each contiguous run
    for w in windows:
        if runs and runs[-1][1] == w.score_from:
            runs[-1][1] = w.end
        else:
            runs.append([w.score_from, w.end])
    return " ".join(text[token_ends[first - 1] : token_ends[end - 1]] for first, end in runs)


def count_words(text: str) -> int:
    """lm-eval's word count: ``len(re.split(r"\\s+", doc))`` on the stripped text."""
    stripped = text.strip()
    return len(re.split(r"\s+", stripped)) if stripped else 0
