import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnsurg.eval.perplexity import run_perplexity, score_windows, tokenize
from attnsurg.eval.windows import plan_windows
from attnsurg.requests import ModelRef, PerplexityEval, TextData


def straightforward_nll(model, ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """The Hugging Face guide's loop, written independently: labels masked with -100, mean loss x count."""
    total, count, previous_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        inputs = ids[begin:end][None]
        labels = inputs.clone()
        labels[:, : max(previous_end - begin, 0)] = -100
        scored = int((labels[:, 1:] != -100).sum())
        if scored:
            with torch.no_grad():
                loss = model(input_ids=inputs, labels=labels).loss
            total += loss.double().item() * scored
            count += scored
        previous_end = end
        if end == len(ids):
            break
    return total, count


@pytest.mark.parametrize("max_length,stride,batch_size", [(64, 64, 1), (64, 64, 3), (64, 24, 1), (50, 17, 2)])
def test_perplexity_matches_straightforward_computation(tiny_checkpoint, corpus_file, max_length, stride, batch_size):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tokens = tokenize(tokenizer, corpus_file.read_text(), max_tokens=400)
    windows = plan_windows(len(tokens.ids), max_length, stride)
    score = score_windows(model, tokens.ids, windows, batch_size, torch.device("cpu"), "tiny")
    expected_nll, expected_count = straightforward_nll(model, tokens.ids, max_length, stride)
    assert score.tokens == expected_count
    assert score.nll == pytest.approx(expected_nll, rel=1e-5)


def test_report_compares_models_on_the_same_windows(tiny_checkpoints, corpus_file):
    request = PerplexityEval(
        models=[ModelRef(ref=str(tiny_checkpoints["llama-gqa"])), ModelRef(ref=str(tiny_checkpoints["qwen2"]))],
        data=TextData(text=corpus_file),
        max_length=128,
        max_tokens=512,
        device="cpu",
    )
    report = run_perplexity(request)
    first, second = report.results
    assert first.tokens_scored == second.tokens_scored == 4 * 127
    assert first.ratio == 1.0 and second.ratio == pytest.approx(second.ppl / first.ppl)
    assert first.ppl == pytest.approx(math.exp(first.nll / first.tokens_scored))
    assert first.bits_per_byte == pytest.approx(math.log2(first.byte_ppl))
    assert first.word_ppl > first.ppl  # words are longer than tokens here
    assert first.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x (k, v) x KV heads x head dim x fp32
    assert report.notes == []


def test_bits_per_byte_counts_the_bytes_of_scored_text(tiny_checkpoints, tmp_path):
    text = "naïve café " * 200
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    request = PerplexityEval(
        models=[ModelRef(ref=str(tiny_checkpoints["llama-gqa"]))], data=TextData(text=path), max_length=64, stride=16, device="cpu"
    )
    result = run_perplexity(request).results[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["llama-gqa"])
    first_token = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:1])
    scored_bytes = len(text.encode()) - len(first_token.encode())  # sliding windows score all but the first token
    assert result.bits_per_byte == pytest.approx(result.nll / (scored_bytes * math.log(2)), rel=1e-9)


def test_several_texts_give_a_ratio_matrix_and_each_models_worst_text(tiny_checkpoints, corpus_file, tmp_path):
    other = tmp_path / "numbers.txt"
    other.write_text(" ".join(str(i) for i in range(3000)), encoding="utf-8")
    models = [ModelRef(ref=str(tiny_checkpoints["llama-gqa"])), ModelRef(ref=str(tiny_checkpoints["qwen2"]))]
    common = dict(models=models, max_length=128, max_tokens=256, device="cpu")
    report = run_perplexity(PerplexityEval(data=TextData(text=corpus_file), more_data=[TextData(text=other)], **common))
    assert report.texts == [str(corpus_file), str(other)] and len(report.results) == 4
    for text in report.texts:  # each text scores as it does alone
        alone = run_perplexity(PerplexityEval(data=TextData(text=text), **common))
        for model in models:
            assert report.row(model.ref, text).ppl == pytest.approx(alone.row(model.ref, text).ppl, rel=1e-9)
    second = models[1].ref
    assert report.ratios[models[0].ref] == {str(corpus_file): 1.0, str(other): 1.0}
    assert report.ratios[second][str(other)] == pytest.approx(report.row(second, str(other)).ppl / report.row(models[0].ref, str(other)).ppl)
    assert report.worst[second] == max(report.ratios[second], key=report.ratios[second].get)


def test_a_prefix_tokenizes_as_the_whole_text_does(tokenizer):
    from attnsurg.eval import perplexity

    from tests.conftest import CORPUS

    text = CORPUS * 20
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = perplexity.tokenize(tokenizer, text, 300)
    assert len(text) > (300 + perplexity.PREFIX_MARGIN_TOKENS) * perplexity.PREFIX_CHARS_PER_TOKEN  # the prefix path
    assert tokens.ids.tolist() == whole[:300] and len(tokens.ends) == 300
    assert perplexity.tokenize(tokenizer, text, None).ids.tolist() == whole


def test_an_mla_checkpoint_is_scored_in_the_attnsurg_runtime_with_the_stock_perplexity(tiny_mla, corpus_file, monkeypatch):
    import attnsurg.eval.loading as loading

    request = PerplexityEval(models=[ModelRef(ref=str(tiny_mla))], data=TextData(text=corpus_file), max_length=128,
                             max_tokens=512, device="cpu")
    switch, switched = loading.use_runtime, []
    monkeypatch.setattr(loading, "use_runtime", lambda model, runtime: switched.append(switch(model, runtime)))
    absorbed = run_perplexity(request).results[0]
    monkeypatch.setattr(loading, "use_runtime", lambda model, runtime: switch(model, "stock"))
    stock = run_perplexity(request).results[0]
    assert switched == [2]  # both layers' attention
    assert absorbed.ppl == pytest.approx(stock.ppl, rel=1e-5) and absorbed.tokens_scored == stock.tokens_scored


def test_the_loki_line_names_the_head_dim_of_a_config_without_one():
    """Qwen2's config has no head_dim attribute (it is hidden_size / heads): the line still says it."""
    from transformers import Qwen2Config

    from attnsurg.eval.perplexity import surgery_settings

    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    config.attnsurg = {"loki": {"rank": 8, "top_k": 0.25, "basis": "pre-rotary"}}
    assert not hasattr(config, "head_dim")
    assert surgery_settings(config) == "loki: rank 8 of head dim 16, top-k 0.25 of each query's context, pre-rotary basis"


@pytest.mark.parametrize("max_length,stride", [(300, 300), (300, 120)])
def test_a_window_read_in_chunks_through_the_cache_scores_as_one_forward(max_length, stride, corpus_file, tokenizer,
                                                                        monkeypatch):
    """Long windows are read ``LONG_WINDOW`` tokens per forward through the model's cache (lowered here to 64):
    the same NLL as the straightforward loop, strided windows included, and per band of positions the tokens
    add up to the whole."""
    import attnsurg.eval.perplexity as perplexity
    from conftest import build_tiny

    model = build_tiny("llama", 384, num_key_value_heads=2, max_position_embeddings=1024).eval()
    tokens = tokenize(tokenizer, corpus_file.read_text(), max_tokens=900)
    windows = plan_windows(len(tokens.ids), max_length, stride)
    monkeypatch.setattr(perplexity, "LONG_WINDOW", 64)
    chunked = score_windows(model, tokens.ids, windows, 1, torch.device("cpu"), "tiny")
    expected_nll, expected_count = straightforward_nll(model, tokens.ids, max_length, stride)
    assert chunked.tokens == expected_count and chunked.nll == pytest.approx(expected_nll, rel=1e-5)
    banded = score_windows(model, tokens.ids, windows, 1, torch.device("cpu"), "tiny", perplexity.position_bands(300))
    assert sum(count for _, count in banded.by_position.values()) == expected_count
    assert sum(nll for nll, _ in banded.by_position.values()) == pytest.approx(expected_nll, rel=1e-5)


def test_perplexity_by_position_gives_each_band_and_its_ratio(tiny_checkpoints, corpus_file):
    from attnsurg.eval.perplexity import position_bands

    assert position_bands(8192) == [(0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]
    assert position_bands(300) == [(0, 300)]
    request = PerplexityEval(models=[ModelRef(ref=str(tiny_checkpoints["llama-gqa"])),
                                     ModelRef(ref=str(tiny_checkpoints["qwen2"]))],
                             data=TextData(text=corpus_file), max_length=128, max_tokens=512, device="cpu",
                             by_position=True)
    first, second = run_perplexity(request).results
    assert first.ppl_by_position == {"0-128": pytest.approx(first.ppl)}
    assert second.ratio_by_position == {"0-128": pytest.approx(second.ratio)}
