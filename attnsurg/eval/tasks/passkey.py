"""``passkey``: a five-digit key hidden in repeated filler, retrieved by greedy generation (Mohtashami and
Jaggi 2023, "Landmark Attention", appendix; the filler and question are theirs).

At each length the key sits at five depths (start, quarter, middle, three quarters, end of the filler);
a retrieval counts when the first number generated is the key. The rate per length shows where a
converted model stops reading its whole context.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

from attnsurg.errors import UserError
from attnsurg.eval.tasks.base import TaskResult, mean
from attnsurg.eval.tasks.scoring import encode, greedy_generate

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FIRST_LENGTH = 512
NEW_TOKENS = 8  # generated after the prompt: the key and a little more
DEFAULT_LONGEST = 4096  # 8192 tokens cost a minute a prompt on 2 CPU cores; ask for them by name
KEY_SEED = 0


@dataclass(frozen=True)
class PasskeyItem:
    id: str
    length: int
    depth: float
    key: str
    prompt: str


def default_lengths(max_positions: int, longest: int = DEFAULT_LONGEST) -> list[int]:
    """512, 1024, 2048, ... up to the model's context (less the generated tokens) or ``longest``."""
    lengths, length = [], FIRST_LENGTH
    while length <= min(max_positions - NEW_TOKENS, longest):
        lengths.append(length)
        length *= 2
    return lengths


def check_lengths(lengths: list[int], max_positions: int) -> None:
    if not lengths:
        raise UserError(f"the model's context ({max_positions} positions) is shorter than the shortest default passkey "
                        f"length ({FIRST_LENGTH}); give --passkey-lengths")
    too_long = [n for n in lengths if n + NEW_TOKENS > max_positions]
    if too_long:
        raise UserError(f"passkey length {too_long[0]} (+ {NEW_TOKENS} generated tokens) is beyond the model's context "
                        f"({max_positions} positions); use --passkey-lengths up to {max_positions - NEW_TOKENS}")
    if any(n < 64 for n in lengths):
        raise UserError("passkey lengths must be at least 64 tokens")


def build_prompt(tokenizer, length: int, depth: float, key: str) -> str:
    """The prompt of about ``length`` tokens (never more) with the key after ``depth`` of the filler."""
    fixed = len(encode(tokenizer, INTRO + NEEDLE.format(key=key) + QUESTION))
    per_filler = len(encode(tokenizer, FILLER * 8)) / 8
    repeats = max(int((length - fixed) / per_filler), 1)
    while True:
        before = round(repeats * depth)
        prompt = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (repeats - before) + QUESTION
        if len(encode(tokenizer, prompt)) <= length or repeats == 1:
            return prompt
        repeats -= 1


def passkey_items(tokenizer, lengths: list[int]) -> list[PasskeyItem]:
    rng = random.Random(KEY_SEED)
    items = []
    for length in lengths:
        for depth in DEPTHS:
            key = str(rng.randrange(10_000, 100_000))
            items.append(PasskeyItem(f"len{length}-depth{depth:g}", length, depth, key,
                                     build_prompt(tokenizer, length, depth, key)))
    return items


def retrieved(generated: str, key: str) -> bool:
    number = re.search(r"\d+", generated)
    return bool(number) and number.group(0) == key


def score_passkey(model, tokenizer, items: list[PasskeyItem]) -> TaskResult:
    start = time.perf_counter()
    hits = []
    for item in items:
        generated = tokenizer.decode(greedy_generate(model, encode(tokenizer, item.prompt), NEW_TOKENS))
        hits.append(1.0 if retrieved(generated, item.key) else 0.0)
    per_length: dict[str, float] = {}
    for length in sorted({item.length for item in items}):
        per_length[str(length)] = mean([h for h, item in zip(hits, items) if item.length == length])
    return TaskResult(
        task="passkey",
        metrics={"acc": mean(hits), "items": len(items)},
        items={"acc": hits},
        details={"acc_by_length": per_length},
        seconds=time.perf_counter() - start,
    )
