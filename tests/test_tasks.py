import math

import pytest
import torch
import torch.nn.functional as F

from attnsurg.errors import UserError
from attnsurg.eval.tasks import parse_tasks
from attnsurg.eval.tasks.base import ChoiceItem, choice_credit, multiple_choice, retained
from attnsurg.eval.tasks.cloze import cloze_items, score_cloze
from attnsurg.eval.tasks.facts import fact_items, in_sentence, score_facts
from attnsurg.eval.tasks.passkey import check_lengths, default_lengths, passkey_items, retrieved, score_passkey
from attnsurg.eval.tasks.scoring import Continuation, encode, encode_pair, greedy_generate, loglikelihoods
from tests.conftest import build_tiny

COUNTRIES = {
    iso: {"iso": iso, "name": name, "capital": capital, "continentcode": continent, "population": 10**6}
    for iso, name, capital, continent in [
        ("FR", "France", "Paris", "EU"), ("DE", "Germany", "Berlin", "EU"), ("IT", "Italy", "Rome", "EU"),
        ("ES", "Spain", "Madrid", "EU"), ("NL", "The Netherlands", "Amsterdam", "EU"), ("JP", "Japan", "Tokyo", "AS"),
        ("KW", "Kuwait", "Kuwait City", "AS"), ("US", "United States", "Washington", "NA"),
        ("XX", "Tiny Isle", "Smalltown", "OC"),
    ]
}
COUNTRIES["XX"]["population"] = 50


class Output(dict):
    __getattr__ = dict.__getitem__


class Planted(torch.nn.Module):
    """A model rigged to the answers: it predicts the next token of whichever known sequence its input
    continues (end of text elsewhere), through the same calls a real model gets, cache included."""

    def __init__(self, sequences: list[list[int]], vocab_size: int, eos: int = 0):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.vocab_size, self.eos = vocab_size, eos
        self.next: dict[tuple[int, ...], int] = {}
        for seq in sequences:
            for i in range(1, len(seq)):
                self.next.setdefault(tuple(seq[:i]), seq[i])

    def forward(self, input_ids, cache=None, use_cache=False, logits_to_keep=0):
        rows = []
        for row in input_ids.tolist():
            history = (cache or []) + row
            rows.append([self.next.get(tuple(history[: len(cache or []) + p + 1]), self.eos) for p in range(len(row))])
        logits = F.one_hot(torch.tensor(rows), self.vocab_size).float() * 30.0
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return Output(logits=logits, cache=(cache or []) + input_ids[0].tolist() if use_cache else None)


class Uniform(Planted):
    def __init__(self, vocab_size: int):
        super().__init__([], vocab_size)

    def forward(self, input_ids, cache=None, use_cache=False, logits_to_keep=0):
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        return Output(logits=logits, cache=[] if use_cache else None)


def planted_for(tokenizer, pairs: list[tuple[str, str]]) -> Planted:
    sequences = []
    for context, answer in pairs:
        pair = encode_pair(tokenizer, context, answer)
        sequences.append(pair.context + pair.continuation + [tokenizer.eos_token_id])
    return Planted(sequences, len(tokenizer), tokenizer.eos_token_id)


def test_encode_pair_moves_trailing_space_to_the_continuation(tokenizer):
    pair = encode_pair(tokenizer, "The capital of France is ", "Paris")
    assert pair.context == encode(tokenizer, "The capital of France is")
    assert pair.context + pair.continuation == encode(tokenizer, "The capital of France is Paris")


def test_loglikelihood_is_the_hand_computed_sum(tokenizer):
    model = build_tiny("llama", len(tokenizer), num_key_value_heads=2)
    pairs = [encode_pair(tokenizer, "The cat sat on", " the mat"), encode_pair(tokenizer, "A", " dog barked loudly"),
             encode_pair(tokenizer, "The cat sat on", " a chair")]
    results = loglikelihoods(model, pairs, max_length=256, batch_size=2)
    for pair, result in zip(pairs, results):
        ids = torch.tensor([pair.context + pair.continuation])
        with torch.no_grad():
            logprobs = F.log_softmax(model(ids).logits[0].double(), -1)
        positions = range(len(pair.context) - 1, ids.shape[1] - 1)
        expected = sum(logprobs[p, ids[0, p + 1]].item() for p in positions)
        greedy = all(logprobs[p].argmax().item() == ids[0, p + 1].item() for p in positions)
        assert result.logprob == pytest.approx(expected, abs=1e-4) and result.is_greedy == greedy


def test_left_truncation_keeps_the_continuation(tokenizer):
    model = build_tiny("llama", len(tokenizer), num_key_value_heads=2)
    pair = Continuation(list(range(5, 60)), [7, 8, 9])
    short = loglikelihoods(model, [pair], max_length=10)[0]
    same = loglikelihoods(model, [Continuation(list(range(5, 60))[-8:], [7, 8, 9])], max_length=256)[0]
    assert short.logprob == pytest.approx(same.logprob, abs=1e-5)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2", "qwen3"])
def test_greedy_generation_with_the_cache_matches_transformers(tokenizer, variant):
    family = {"llama-gqa": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[variant]
    model = build_tiny(family, len(tokenizer), num_key_value_heads=2)
    prompt = encode(tokenizer, "The grass is green. The sky is")
    ours = greedy_generate(model, prompt, 6)
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=None)
    assert ours == theirs[0, len(prompt):].tolist()


def test_ties_share_credit_and_retained_counts_the_reference_rights():
    assert choice_credit([-1.0, -2.0, -3.0, -4.0], 0) == 1.0
    assert choice_credit([-1.0, -1.0, -3.0, -4.0], 1) == 0.5
    assert choice_credit([-1.0, -1.0, -3.0, -4.0], 2) == 0.0
    assert retained([1, 1, 0, 1], [1, 0, 1, 1]) == pytest.approx(2 / 3)
    assert math.isnan(retained([0, 0], [1, 1]))


def test_fact_items_read_the_country_table():
    items = fact_items(COUNTRIES)
    contexts = [item.context for item in items]
    assert "The capital of France is" in contexts and "The capital of the Netherlands is" in contexts
    assert "The capital of the United States is" in contexts
    assert not any("Kuwait" in c and "capital" in c for c in contexts)  # the capital repeats the name
    assert not any("Tiny Isle" in c for c in contexts)  # below the population floor
    assert "The Netherlands is located in the continent of" in contexts
    for item in items:
        assert len(item.choices) == 4 and len(set(item.choices)) == 4
    france = next(item for item in items if item.context == "The capital of France is")
    assert france.choices[france.answer] == " Paris"
    assert {c.strip() for c in france.choices} <= {"Paris", "Berlin", "Rome", "Madrid", "Amsterdam"}  # same continent
    assert in_sentence("Philippines") == "the Philippines"


def test_planted_model_scores_every_task_perfectly_and_uniform_scores_chance(tokenizer):
    facts = fact_items(COUNTRIES)
    documents = [" ".join(["The river runs past the old mill and the mill stands by the river."] * 6)] * 3
    cloze = cloze_items(documents, limit=10)
    passkeys = passkey_items(tokenizer, [256, 384])
    assert cloze and len(passkeys) == 10
    pairs = [(i.context, i.choices[i.answer]) for i in facts] + [(i.context, i.target) for i in cloze]
    pairs += [(i.prompt, f" {i.key}.") for i in passkeys]
    planted = planted_for(tokenizer, pairs)
    assert score_facts(planted, tokenizer, facts, 256).metrics["choice_acc"] == 1.0
    assert score_facts(planted, tokenizer, facts, 256).metrics["greedy_acc"] == 1.0
    assert score_cloze(planted, tokenizer, cloze, 256).metrics["acc"] == 1.0
    result = score_passkey(planted, tokenizer, passkeys)
    assert result.metrics["acc"] == 1.0 and result.details["acc_by_length"] == {"256": 1.0, "384": 1.0}

    uniform = Uniform(len(tokenizer))
    letters = [ChoiceItem(str(i), "Answer:", ("a", "b", "c", "d"), i % 4) for i in range(8)]
    assert all(len(encode_pair(tokenizer, "Answer:", c).continuation) == 1 for c in "abcd")
    assert multiple_choice(uniform, tokenizer, letters, 256)[0] == [0.25] * 8
    assert score_facts(uniform, tokenizer, facts, 256).metrics["greedy_acc"] == 0.0
    assert score_passkey(uniform, tokenizer, passkeys).metrics["acc"] == 0.0


def test_passkey_prompts_fit_their_length_and_hide_the_key(tokenizer):
    items = passkey_items(tokenizer, [256, 512])
    for item in items:
        n = len(encode(tokenizer, item.prompt))
        assert item.length * 0.8 <= n <= item.length
        assert f"The pass key is {item.key}." in item.prompt
    middle = next(i for i in items if i.length == 512 and i.depth == 0.5)
    assert 0.3 < middle.prompt.index(middle.key) / len(middle.prompt) < 0.7
    assert retrieved(" 12345. Remember", "12345") and not retrieved(" 1234", "12345") and not retrieved(" none", "1")


def test_passkey_lengths_stop_at_the_context():
    assert default_lengths(8192) == [512, 1024, 2048, 4096]
    assert default_lengths(8192, longest=8192) == [512, 1024, 2048, 4096]  # 8192 + the generated tokens do not fit
    assert default_lengths(32768, longest=8192) == [512, 1024, 2048, 4096, 8192]
    assert default_lengths(3000) == [512, 1024, 2048]
    with pytest.raises(UserError, match="beyond the model's context"):
        check_lengths([1024, 4096], 2048)


def test_cloze_items_need_the_target_in_the_context():
    assert cloze_items(["Short paragraph ending in nothing."], 5) == []
    context = " ".join(["Words about the lighthouse keeper and the storm."] * 10)
    [item] = cloze_items([context + " At dawn he climbed the lighthouse."], 5)
    assert item.target == " lighthouse" and item.context.endswith("he climbed the")


def test_unknown_task_is_one_clear_error():
    assert parse_tasks("facts, passkey") == ["facts", "passkey"]
    with pytest.raises(UserError, match="unknown task 'hellaswag'"):
        parse_tasks("facts,hellaswag")
