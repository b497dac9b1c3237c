"""``retrieval``: keys and values hidden in natural text, retrieved by greedy generation (RULER: Hsieh et al.
2024, its needle-in-a-haystack and variable-tracking tasks, in a natural haystack: sentences of the wiki
sample's evaluation half, from a seeded offset per haystack).

Each haystack is read once (``scoring.prefill``, in chunks) and every question about it continues a copy of
its cache (``scoring.greedy_after``), guessing the right answer so that one forward checks all of its tokens,
and decoding only until the credit is settled (a lookup's number has ended or left the value). So a length
costs a few prefills and a forward or two per question.

Variants (``VARIANTS``):

- ``multikey``: sixteen needles, "One of the special magic numbers for {key} is: {value}.", at spread depths,
  each asked in turn while the other fifteen stand as distractors (RULER's ``niah_multikey_1``, with more
  needles so that a length needs five prefills for 80 questions); keys share no word within a haystack;
- ``single``: one needle a haystack, its depth moving across the haystacks (``niah_single_2``);
- ``multivalue``: two keys with four values each, all four asked for at once; credit is the share named
  (``niah_multivalue``);
- ``tracking``: two chains of variable assignments ("VAR ABCDE = 1234567." then "VAR FGHIJ = VAR ABCDE.")
  spread through the text, each asked for every variable that holds its value; credit is the share named.
  Not a lookup: the answer needs every link (``vt``).

A question's credit is 1 when the first number generated is the value (lookups), or the share of the expected
names or values in the generated text (the two many-answer variants). Rates per length come with their
standard error, sqrt(p (1 - p) / n).
"""

from __future__ import annotations

import math
import random
import re
import string
import time
from dataclasses import dataclass, field

from attnsurg.data import load_text
from attnsurg.errors import UserError
from attnsurg.eval.tasks.base import TaskResult, mean
from attnsurg.eval.tasks.scoring import encode, greedy_after, prefill

VARIANTS = ("multikey", "single", "multivalue", "tracking")
DEFAULT_VARIANTS = ("multikey",)
DEFAULT_QUESTIONS = 80  # per length and variant: a standard error of at most 0.056
FIRST_LENGTH = 2048  # 16 needles take about a third of 1K tokens: shorter lengths are asked for by name
HAYSTACK = "wiki-sample"
SEED = 0

INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
         "I will quiz you about the numbers afterwards.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
ASK_ONE = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
           "The special magic number for {key} mentioned in the provided text is")
ASK_ALL = ("\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
           "The special magic numbers for {key} mentioned in the provided text are")
TRACKING_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
ASSIGN_VALUE = "VAR {name} = {value}."
ASSIGN_NAME = "VAR {name} = VAR {previous}."
ASK_TRACKING = ("\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
                "According to the chain(s) of variable assignment in the text above, {count} variables are "
                "assigned the value {value}, they are:")
# Keys are an adjective and a noun: readable words that occur together nowhere in the haystack.
ADJECTIVES = ("amber brave calm dusty eager faint gentle hollow icy jolly keen lofty mellow narrow olive proud "
              "quiet rapid silent tidy upper vivid wary young zealous brisk crisp dim fierce grand").split()
NOUNS = ("anchor badger candle dolphin engine falcon garden harbor island jacket kettle lantern meadow needle "
         "orchard pebble quarry ribbon saddle tunnel umbrella valley walnut yarrow zephyr beacon canyon "
         "drum ember forge").split()


@dataclass(frozen=True)
class Question:
    """What is asked after the haystack, and what counts: ``answers`` are the value (lookups) or every
    expected value or name (``all_of``: credit is the share found)."""

    text: str
    answers: tuple[str, ...]
    all_of: bool = False

    def guess(self, generated: str) -> str:
        """What a right reply says next (checked in one forward, ``scoring.greedy_after``): the answer, until
        one is begun; then nothing."""
        if re.search(r"\d", generated) or any(answer in generated for answer in self.answers):
            return ""
        answer = ", ".join(self.answers) + "."
        return answer if generated[-1:].isspace() else " " + answer

    @property
    def new_tokens(self) -> int:
        return 12 if not self.all_of else 12 * len(self.answers)

    def settled(self, generated: str) -> bool:
        """Whether more tokens can no longer change the credit: a lookup's first number has ended or has
        left the value's digits, or every expected answer is named."""
        if self.all_of:
            return all(answer in generated for answer in self.answers)
        first = re.search(r"\d+", generated)
        return first is not None and (first.end() < len(generated) or not self.answers[0].startswith(first.group(0)))


@dataclass(frozen=True)
class Haystack:
    id: str
    variant: str
    length: int
    context: str  # intro, sentences and the hidden facts: read once
    questions: tuple[Question, ...] = field(default_factory=tuple)


NEEDLES = 16  # multikey: needles in one haystack, each asked in turn with the others as distractors
QUESTIONS_PER_HAYSTACK = {"multikey": NEEDLES, "single": 1, "multivalue": 2, "tracking": 2}
CHAIN_LENGTH = 5  # variables in one tracking chain


# ---------------------------------------------------------------------------------------- the haystack text
def sentences(text: str) -> list[str]:
    """The text as sentences, so facts are hidden between sentences, never inside one."""
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


@dataclass
class SentencePool:
    """The haystack's sentences and their token counts under one tokenizer (counted once)."""

    sentences: list[str]
    tokens: list[int]

    @classmethod
    def of(cls, tokenizer) -> SentencePool:
        found = sentences(load_text(HAYSTACK, None, "eval").text)
        counts = [len(ids) for ids in tokenizer([" " + s for s in found], add_special_tokens=False)["input_ids"]]
        return cls(found, counts)

    def run(self, start: int, budget: int) -> list[str]:
        """Consecutive sentences from ``start`` (wrapping around) holding at most ``budget`` tokens."""
        taken, used, i = [], 0, start
        while used + self.tokens[i % len(self.tokens)] <= budget and len(taken) < len(self.tokens):
            taken.append(self.sentences[i % len(self.sentences)])
            used += self.tokens[i % len(self.tokens)]
            i += 1
        return taken


# ---------------------------------------------------------------------------------------- what is hidden
def number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def distinct_keys(rng: random.Random, count: int) -> list[str]:
    """Keys that share no word with each other, so no two are told apart by one word alone."""
    return [f"{a}-{n}" for a, n in zip(rng.sample(ADJECTIVES, count), rng.sample(NOUNS, count), strict=True)]


def variable_names(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
    return sorted(names, key=lambda _: rng.random())


def hidden_facts(variant: str, rng: random.Random) -> tuple[list[str], list[Question]]:
    """The sentences hidden in one haystack (in the order they are placed) and the questions about them."""
    if variant == "multikey":
        keys = distinct_keys(rng, NEEDLES)
        values = [number(rng) for _ in keys]
        facts = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
        return facts, [Question(ASK_ONE.format(key=k), (v,)) for k, v in zip(keys, values, strict=True)]
    if variant == "single":
        key, value = distinct_keys(rng, 1)[0], number(rng)
        return [NEEDLE.format(key=key, value=value)], [Question(ASK_ONE.format(key=key), (value,))]
    if variant == "multivalue":
        keys = distinct_keys(rng, 2)
        values = {key: [number(rng) for _ in range(4)] for key in keys}
        facts = [NEEDLE.format(key=key, value=values[key][i]) for i in range(4) for key in keys]  # interleaved
        return facts, [Question(ASK_ALL.format(key=key), tuple(values[key]), all_of=True) for key in keys]
    names = variable_names(rng, 2 * CHAIN_LENGTH)
    chains = [names[:CHAIN_LENGTH], names[CHAIN_LENGTH:]]
    values = [number(rng) for _ in chains]
    facts = []
    for hop in range(CHAIN_LENGTH):  # the two chains' links interleaved, each after the one it copies
        for chain, value in zip(chains, values, strict=True):
            facts.append(ASSIGN_VALUE.format(name=chain[0], value=value) if hop == 0 else
                         ASSIGN_NAME.format(name=chain[hop], previous=chain[hop - 1]))
    return facts, [Question(ASK_TRACKING.format(value=value, count=CHAIN_LENGTH), tuple(chain), all_of=True)
                   for chain, value in zip(chains, values, strict=True)]


def depths(count: int, index: int, haystacks: int, variant: str) -> list[float]:
    """Where the facts sit, as shares of the haystack: spread evenly; a single needle moves from the start to
    the end across the haystacks."""
    if variant == "single":
        return [(index + 0.5) / haystacks]
    return [(i + 0.5) / count for i in range(count)]


# ---------------------------------------------------------------------------------------- items
def build_haystack(tokenizer, pool: SentencePool, variant: str, length: int, index: int, haystacks: int) -> Haystack:
    """One haystack of at most ``length`` tokens with its questions (longest question and answer included)."""
    rng = random.Random(f"{SEED}-{variant}-{length}-{index}")
    facts, questions = hidden_facts(variant, rng)
    intro = TRACKING_INTRO if variant == "tracking" else INTRO
    reserve = max(len(encode(tokenizer, q.text)) + q.new_tokens for q in questions)
    fixed = len(encode(tokenizer, intro + " ".join(facts)))
    budget = length - reserve - fixed - len(facts) - 2
    if budget < 64:
        raise UserError(f"retrieval length {length} leaves no room for a haystack around its {len(facts)} fact(s); "
                        f"use lengths of at least {length - budget + 64}")
    filler = pool.run(rng.randrange(len(pool.sentences)), budget)
    while True:
        context = intro + place(filler, facts, depths(len(facts), index, haystacks, variant))
        if len(encode(tokenizer, context)) + reserve <= length or not filler:
            break
        filler = filler[:-max(1, len(filler) // 100)]  # joined, sentences tokenize a little differently
    return Haystack(f"{variant}-len{length}-{index}", variant, length, context, tuple(questions))


def place(filler: list[str], facts: list[str], at: list[float]) -> str:
    """The filler sentences with each fact inserted at its share of them."""
    cuts = [round(share * len(filler)) for share in at]
    pieces, start = [], 0
    for cut, fact in zip(cuts, facts, strict=True):
        pieces += filler[start:cut] + [fact]
        start = cut
    return " ".join(pieces + filler[start:])


def retrieval_items(tokenizer, lengths: list[int], variants: list[str], questions: int) -> list[Haystack]:
    """Every haystack of the request: enough per length and variant for ``questions`` questions. A pure
    function of the seed and the tokenizer."""
    pool = SentencePool.of(tokenizer)
    items = []
    for variant in variants:
        haystacks = math.ceil(questions / QUESTIONS_PER_HAYSTACK[variant])
        for length in lengths:
            items += [build_haystack(tokenizer, pool, variant, length, i, haystacks) for i in range(haystacks)]
    return items


# ---------------------------------------------------------------------------------------- scoring
def credit(generated: str, question: Question) -> float:
    if question.all_of:
        return sum(answer in generated for answer in question.answers) / len(question.answers)
    first = re.search(r"\d+", generated)
    return 1.0 if first and first.group(0) == question.answers[0] else 0.0


def standard_error(credits: list[float]) -> float:
    p = mean(credits)
    return math.sqrt(max(p * (1 - p), 0.0) / len(credits)) if credits else float("nan")


def score_retrieval(model, tokenizer, items: list[Haystack]) -> TaskResult:
    """Each haystack read once, each of its questions answered on a copy of that read."""
    start = time.perf_counter()
    credits, rows = [], []
    several = len({haystack.variant for haystack in items}) > 1
    for haystack in items:
        read = prefill(model, encode(tokenizer, haystack.context))
        for question in haystack.questions:
            answer = greedy_after(model, read, encode(tokenizer, question.text), question.new_tokens,
                                  guess=lambda tokens, q=question: encode(tokenizer, q.guess(tokenizer.decode(tokens))),
                                  finished=lambda tokens, q=question: q.settled(tokenizer.decode(tokens)))
            credits.append(credit(tokenizer.decode(answer), question))
            rows.append(f"{haystack.variant} {haystack.length}" if several else str(haystack.length))
        del read
    by_row = {row: [c for c, r in zip(credits, rows, strict=True) if r == row] for row in dict.fromkeys(rows)}
    return TaskResult(
        task="retrieval",
        metrics={"acc": mean(credits), "items": len(credits)},
        items={"acc": credits, **{f"acc {row}": found for row, found in by_row.items()}},  # each row's kept share
        details={"acc_by_length": {row: mean(found) for row, found in by_row.items()},
                 "stderr_by_length": {row: standard_error(found) for row, found in by_row.items()},
                 "questions_by_length": {row: len(found) for row, found in by_row.items()}},
        seconds=time.perf_counter() - start,
    )


# ---------------------------------------------------------------------------------------- lengths
def default_lengths(max_positions: int) -> list[int]:
    """2048, 4096, ... and the model's whole context last (as written in its config)."""
    lengths, length = [], FIRST_LENGTH
    while length < max_positions:
        lengths.append(length)
        length *= 2
    return lengths + [max_positions]


def check_lengths(lengths: list[int], max_positions: int) -> None:
    if too_long := [n for n in lengths if n > max_positions]:
        raise UserError(f"retrieval length {too_long[0]} is beyond the model's context ({max_positions} positions); "
                        f"use --retrieval-lengths up to {max_positions}")
    if too_short := [n for n in lengths if n < 256]:
        raise UserError(f"retrieval length {too_short[0]} is too short to hide facts in; use at least 256 tokens")
