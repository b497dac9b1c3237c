"""``cloze``: LAMBADA-style last-word prediction on passages of wiki-sample's evaluation half.

LAMBADA (Paperno et al. 2016) keeps passages whose last word humans can guess only with the whole passage.
Without annotators, a paragraph qualifies here when it ends in a word of at least four letters that
already occurred in the article text before it (the last 80 words form the context, at least 50; LAMBADA's average is about 75), so
predicting it rewards reading the context, the property attention surgery can break. At most two items per
article, articles in order. Scored as lm-eval scores ``lambada``:
accuracy is whether greedy decoding produces the word (every token the argmax), and the perplexity of the
target word over all items.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

from attnsurg.errors import UserError
from attnsurg.eval.tasks.base import TaskResult, mean
from attnsurg.eval.tasks.scoring import encode_pair, loglikelihoods

MIN_WORDS = 50
PER_DOCUMENT = 2
MAX_CONTEXT_WORDS = 80
MIN_TARGET_CHARS = 4
FINAL_WORD = re.compile(r"(?:^|\s)([A-Za-z]+)\.$")


@dataclass(frozen=True)
class ClozeItem:
    id: str
    context: str
    target: str


def paragraph_item(preceding: str, paragraph: str, item_id: str) -> ClozeItem | None:
    """The item a paragraph's last word makes with the article text before it, or None when it does not
    qualify (no content word ends it, the target has not occurred in the context, too little context)."""
    paragraph = " ".join(paragraph.split())
    found = FINAL_WORD.search(paragraph)
    if not found or len(found.group(1)) < MIN_TARGET_CHARS:
        return None
    target = found.group(1)
    context_words = (preceding + " " + paragraph[: found.start(1)]).split()[-MAX_CONTEXT_WORDS:]
    context = " ".join(context_words)
    if len(context_words) < MIN_WORDS or not re.search(rf"\b{re.escape(target)}\b", context, flags=re.I):
        return None
    return ClozeItem(item_id, context, f" {target}")


def cloze_items(documents: list[str], limit: int) -> list[ClozeItem]:
    """Up to ``PER_DOCUMENT`` items per article, articles in order, until ``limit``."""
    items: list[ClozeItem] = []
    for number, document in enumerate(documents):
        paragraphs = [p for p in document.split("\n") if p.strip()]
        found = 0
        for index, paragraph in enumerate(paragraphs):
            item = paragraph_item(" ".join(paragraphs[:index]), paragraph, f"wiki-eval-doc{number}-p{index}")
            if item:
                items.append(item)
                found += 1
                if len(items) == limit:
                    return items
                if found == PER_DOCUMENT:
                    break
    return items


def load_cloze_items(limit: int) -> list[ClozeItem]:
    from attnsurg.data import DOMAINS, domain_documents, half_of

    items = cloze_items(half_of(domain_documents(DOMAINS["wiki-sample"]), "eval"), limit)
    if not items:
        raise UserError("wiki-sample's evaluation half gave no cloze items; delete its cached file and fetch it again "
                        "(attnsurg assets fetch wiki-sample)")
    return items


def score_cloze(model, tokenizer, items: list[ClozeItem], max_length: int) -> TaskResult:
    start = time.perf_counter()
    requests = [encode_pair(tokenizer, item.context, item.target) for item in items]
    likelihoods = loglikelihoods(model, requests, max_length)
    correct = [1.0 if lk.is_greedy else 0.0 for lk in likelihoods]
    nll = -sum(lk.logprob for lk in likelihoods)
    return TaskResult(
        task="cloze",
        metrics={"acc": mean(correct), "ppl": math.exp(nll / len(items)), "items": len(items)},
        items={"acc": correct},
        seconds=time.perf_counter() - start,
    )
