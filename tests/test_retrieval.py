"""The retrieval task: items are a pure function of the seed and the tokenizer, fit their length and hide every
fact; a question answered on a copy of a shared prefill gets the tokens the whole prompt gets alone, and the
shared prefill is never changed; credit is right for the right answer and wrong for noise."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from attnsurg.cli import app
from attnsurg.errors import UserError
from attnsurg.eval.tasks import retrieval
from attnsurg.eval.tasks.retrieval import Question, credit, retrieval_items, standard_error
from attnsurg.eval.tasks.scoring import encode, greedy_after, greedy_generate, prefill, returned_cache
from attnsurg.io.load import load_model, resolve_source

from conftest import build_tiny
from helpers import assert_user_error, fake_assets


@pytest.fixture
def offline_texts(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path / "cache"))
    fake_assets(tmp_path / "cache")


@pytest.fixture(scope="module")
def long_tiny():
    """A tiny Llama with a context long enough for sixteen needles."""
    return build_tiny("llama", 384, num_key_value_heads=2, max_position_embeddings=2048).eval()


@pytest.mark.parametrize("variant", retrieval.VARIANTS)
def test_items_are_a_pure_function_of_the_seed_and_fit_their_length(variant, tokenizer, offline_texts):
    first = retrieval_items(tokenizer, [1100, 1600], [variant], questions=16)
    assert first == retrieval_items(tokenizer, [1100, 1600], [variant], questions=16)
    assert sum(len(h.questions) for h in first if h.length == 1100) >= 16
    for haystack in first:
        for question in haystack.questions:
            total = len(encode(tokenizer, haystack.context + question.text)) + question.new_tokens
            assert total <= haystack.length + 2, (haystack.id, total)  # the two encoded apart may differ by a token
        hidden = [answer for question in haystack.questions for answer in question.answers]
        assert all(answer in haystack.context for answer in hidden)
    for haystack in first:
        asked = [q.text for q in haystack.questions]
        assert len(set(asked)) == len(asked)  # no key hidden twice in one haystack


def test_keys_in_one_haystack_share_no_word():
    import random

    keys = retrieval.distinct_keys(random.Random(0), retrieval.NEEDLES)
    words = [word for key in keys for word in key.split("-")]
    assert len(set(words)) == len(words) == 2 * retrieval.NEEDLES


def test_facts_sit_at_spread_depths(tokenizer, offline_texts):
    haystack = retrieval_items(tokenizer, [1500], ["multikey"], questions=16)[0]
    where = [haystack.context.index(q.answers[0]) / len(haystack.context) for q in haystack.questions]
    assert where == sorted(where) and where[0] < 0.2 and where[-1] > 0.8


@pytest.mark.parametrize("chunk", [7, 2048])
def test_a_question_on_a_shared_prefill_gets_the_tokens_of_the_whole_prompt_alone(chunk, long_tiny, tokenizer,
                                                                                  offline_texts):
    haystack = retrieval_items(tokenizer, [1200], ["multikey"], questions=16)[0]
    context = encode(tokenizer, haystack.context)
    read = prefill(long_tiny, context, chunk=chunk)
    cache = returned_cache(read)
    before = [t.clone() for t in (cache.layers[0].keys, cache.layers[0].values)]
    for question in haystack.questions[:3]:
        asked = encode(tokenizer, question.text)
        assert greedy_after(long_tiny, read, asked, 6) == greedy_generate(long_tiny, context + asked, 6)
    assert cache.get_seq_length() == len(context)  # the shared read is never extended
    for kept, now in zip(before, (cache.layers[0].keys, cache.layers[0].values), strict=True):
        assert torch.equal(kept, now)


def test_a_shared_prefill_serves_an_mla_checkpoint_in_the_attnsurg_runtime(tiny_mla, tokenizer):
    from attnsurg.modeling.absorbed import use_runtime

    model = load_model(resolve_source(str(tiny_mla)))
    use_runtime(model, "attnsurg")
    context = [int(i) for i in torch.randint(0, 384, (200,), generator=torch.Generator().manual_seed(0))]
    asked = [5, 17, 33, 2]
    read = prefill(model, context, chunk=64)
    assert greedy_after(model, read, asked, 5) == greedy_generate(model, context + asked, 5)
    assert greedy_after(model, read, asked, 5) == greedy_generate(model, context + asked, 5)  # twice: read unchanged


def test_credit_is_one_for_the_value_and_zero_for_noise():
    lookup = Question("?", ("1234567",))
    assert credit(" 1234567. It was", lookup) == 1.0
    assert credit(" 7654321 or 1234567", lookup) == 0.0  # the first number is the answer
    assert credit(" the lighthouse", lookup) == 0.0
    many = Question("?", ("ABCDE", "FGHIJ", "KLMNO", "PQRST"), all_of=True)
    assert credit(" ABCDE, KLMNO", many) == 0.5
    assert standard_error([1.0] * 10) == 0.0 and standard_error([1.0, 0.0] * 32) == pytest.approx(0.0625)


@pytest.mark.parametrize("generated", [" 1234567. It was", " 7654321 or 1234567", " 12 34", " none at all, sorry",
                                       " 1234567", " 12345678", " 1235",
                                       " ABCDE, FGHIJ, KLMNO and PQRST.", " ABCDE and"])
def test_decoding_stops_only_where_more_tokens_cannot_change_the_credit(generated):
    for question in (Question("?", ("1234567",)), Question("?", ("ABCDE", "FGHIJ", "KLMNO", "PQRST"), all_of=True)):
        for end in range(len(generated) + 1):
            if question.settled(generated[:end]):
                assert credit(generated[:end], question) == credit(generated, question)


def test_a_finished_answer_is_the_prefix_of_the_full_generation(long_tiny, tokenizer, offline_texts):
    haystack = retrieval_items(tokenizer, [1200], ["multikey"], questions=16)[0]
    read = prefill(long_tiny, encode(tokenizer, haystack.context))
    asked = encode(tokenizer, haystack.questions[0].text)
    full = greedy_after(long_tiny, read, asked, 6)
    assert greedy_after(long_tiny, read, asked, 6, finished=lambda tokens: len(tokens) == 2) == full[:2]


def test_a_model_that_always_answers_scores_one_and_one_that_babbles_zero(tokenizer, offline_texts, monkeypatch):
    """``score_retrieval`` end to end with the decoding replaced: an oracle that returns each question's value,
    and noise."""
    haystacks = retrieval_items(tokenizer, [1200], ["multikey"], questions=16)
    answers = {q.text: q.answers[0] for h in haystacks for q in h.questions}
    monkeypatch.setattr(retrieval, "prefill", lambda model, ids: None)
    for reply, expected in ((lambda text: encode(tokenizer, " " + answers[text]), 1.0),
                            (lambda text: encode(tokenizer, " the sea"), 0.0)):
        monkeypatch.setattr(retrieval, "greedy_after",
                            lambda model, read, ids, n, reply=reply, **_: reply(tokenizer.decode(ids)))
        result = retrieval.score_retrieval(None, tokenizer, haystacks)
        assert result.metrics["acc"] == expected and result.details["questions_by_length"] == {"1200": 16}


def test_lengths_past_the_context_or_too_short_for_the_facts_are_one_line(tiny_checkpoints, tokenizer, offline_texts):
    result = CliRunner().invoke(app, ["eval", "tasks", str(tiny_checkpoints["llama-gqa"]), "--tasks", "retrieval",
                                      "--retrieval-lengths", "512"])
    assert_user_error(result, "beyond the model's context (256 positions)")
    with pytest.raises(UserError, match="leaves no room"):
        retrieval_items(tokenizer, [300], ["multikey"], questions=16)
    with pytest.raises(UserError, match="at least 256"):
        retrieval.check_lengths([128], 2048)
    assert retrieval.default_lengths(8192) == [2048, 4096, 8192]
    assert retrieval.default_lengths(3000) == [2048, 3000]


@pytest.mark.parametrize("guess", ["right", "wrong at the third token", "wrong at once", "noise", "none"])
def test_a_guessed_answer_gives_the_tokens_of_plain_greedy_decoding(guess, long_tiny, tokenizer, offline_texts):
    """Guesses are checked by teacher forcing; the tokens must be greedy decoding's whatever is guessed."""
    haystack = retrieval_items(tokenizer, [1200], ["multikey"], questions=16)[0]
    context = encode(tokenizer, haystack.context)
    read = prefill(long_tiny, context)
    asked = encode(tokenizer, haystack.questions[0].text)
    plain = greedy_generate(long_tiny, context + asked, 8)
    drafts = {"right": plain[:6] + [1, 2, 3, 4], "wrong at the third token": plain[:2] + [(plain[2] + 1) % 384, 7],
              "wrong at once": [(plain[0] + 1) % 384], "noise": [11, 12, 13, 14, 15], "none": []}
    draft = drafts[guess]
    guessed = lambda tokens: draft[len(tokens):]  # noqa: E731
    assert greedy_after(long_tiny, read, asked, 8, guess=guessed) == plain
    for stop in (1, 2, 5):
        assert greedy_after(long_tiny, read, asked, 8, guess=guessed,
                            finished=lambda tokens, stop=stop: len(tokens) == stop) == plain[:stop]
    assert greedy_after(long_tiny, read, asked, 8, guess=guessed, stop_ids={plain[3]}) == plain[:plain.index(plain[3])]
    assert greedy_after(long_tiny, read, asked, 3, guess=lambda tokens: plain) == plain[:3]  # guess past the end


def test_a_question_guesses_its_answer_until_one_is_begun():
    lookup = Question("?", ("1234567",))
    assert lookup.guess("") == " 1234567." and lookup.guess(":") == " 1234567." and lookup.guess(": ") == "1234567."
    assert lookup.guess(" 12") == "" and lookup.guess(" 7654321") == ""
    many = Question("?", ("ABCDE", "FGHIJ"), all_of=True)
    assert many.guess("") == " ABCDE, FGHIJ." and many.guess(" ABCDE") == ""


def test_grouped_queries_in_sdpa_give_the_same_logits_on_a_cache(long_tiny, monkeypatch):
    """A cached forward passes a mask, so transformers copies KV heads unless told to let SDPA group them."""
    import os

    from attnsurg.eval.tasks.scoring import FORCE_GQA, cached_forward, grouped_queries_in_sdpa

    monkeypatch.delenv(FORCE_GQA, raising=False)
    ids = torch.randint(0, 384, (1, 300), generator=torch.Generator().manual_seed(1))
    read = prefill(long_tiny, ids[0, :260].tolist(), chunk=100)
    plain = cached_forward(long_tiny, ids[:, 260:], read, last=40).logits
    read = prefill(long_tiny, ids[0, :260].tolist(), chunk=100)
    with grouped_queries_in_sdpa(torch.device("cpu")):
        assert os.environ[FORCE_GQA] == "1"
        grouped = cached_forward(long_tiny, ids[:, 260:], read, last=40).logits
    assert FORCE_GQA not in os.environ
    torch.testing.assert_close(grouped, plain, rtol=1e-5, atol=1e-5)
