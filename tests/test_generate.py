"""`attnsurg generate` and `attnsurg.load`: the attnsurg runtime's greedy tokens are transformers' own."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import attnsurg
from attnsurg.cli import app
from attnsurg.generate import prompt_ids, run_generate
from attnsurg.modeling.absorbed import AbsorbedMLAAttention
from attnsurg.requests import GenerateRequest, ModelRef

PROMPT = "the quick brown fox jumps over the lazy dog and"


def test_load_returns_a_model_in_the_attnsurg_runtime(tiny_mla):
    model, tokenizer = attnsurg.load(str(tiny_mla))
    assert all(type(layer.self_attn) is AbsorbedMLAAttention for layer in model.model.layers)
    stock, _ = attnsurg.load(str(tiny_mla), runtime="stock")
    assert not any(type(layer.self_attn) is AbsorbedMLAAttention for layer in stock.model.layers)
    assert tokenizer(PROMPT)["input_ids"]


def test_generate_gives_transformers_greedy_tokens(tiny_mla):
    request = GenerateRequest(model=ModelRef(ref=str(tiny_mla)), prompt=PROMPT, max_new_tokens=24, chat=False)
    pieces: list[str] = []
    report = run_generate(request, pieces.append)
    stock = AutoModelForCausalLM.from_pretrained(tiny_mla).eval()
    _, tokenizer = attnsurg.load(str(tiny_mla))
    ids = torch.tensor([prompt_ids(tokenizer, PROMPT, chat=False)])
    expected = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
    assert report.text == tokenizer.decode(expected, skip_special_tokens=True) == "".join(pieces)
    assert report.new_tokens == len(expected) and report.prompt_tokens == ids.shape[1]
    assert report.kv_cache_bytes > 0 and report.runtime == "attnsurg"


def test_the_command_streams_text_then_its_figures(tiny_mla):
    result = CliRunner().invoke(app, ["generate", str(tiny_mla), "--prompt", PROMPT, "--no-chat",
                                      "--max-new-tokens", "8", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert 0 < record["new_tokens"] <= 8 and record["kv_bytes_per_token"] > 0
    streamed = CliRunner().invoke(app, ["generate", str(tiny_mla), "--prompt", PROMPT, "--no-chat",
                                        "--max-new-tokens", "8"])
    assert streamed.exit_code == 0 and "tokens/s" in streamed.stderr and record["text"].strip() in streamed.stdout


@pytest.mark.parametrize("args, message", [
    (["--prompt", "  "], "the prompt is empty"),
    (["--prompt", PROMPT, "--max-new-tokens", "100000"], "new tokens is beyond"),
    (["--prompt", PROMPT, "--runtime", "fast"], "--runtime"),
])
def test_bad_prompts_get_one_line(tiny_mla, args, message):
    result = CliRunner().invoke(app, ["generate", str(tiny_mla), "--no-chat", *args])
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
