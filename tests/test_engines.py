"""Serving engines run what attnsurg writes (``-m engines``): vLLM's CPU build, in its own venv, serves an MLA
conversion laid out by ``--engine vllm`` with no overrides, and its greedy tokens and prompt log-probs are
transformers'. Skipped with the reason where no vLLM venv is found (benchmarks/engine_vllm.py makes one)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from typer.testing import CliRunner

from attnsurg.cli import app

pytestmark = pytest.mark.engines

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


sys.path.insert(0, str(BENCHMARKS))
from engine_vllm import (ROTARY_WORKAROUND, agreement, installed_vllm_python, run_worker,  # noqa: E402
                         transformers_reference, vllm_root)


def vllm_python() -> Path:
    python = installed_vllm_python()
    if python is None:
        pytest.skip(f"no vLLM venv at {vllm_root()}: run benchmarks/engine_vllm.py once, or set ATTNSURG_VLLM_PYTHON")
    return python


@pytest.fixture(scope="module")
def mla_576(tmp_path_factory, tokenizer, corpus_file) -> Path:
    """A tiny MHA Llama (8 heads of 64: 1,024 KV values a token) converted with a budget (0.57: 584 values) for
    vLLM, which takes the widest width its kernels cache within it: 576."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=len(tokenizer), eos_token_id=0, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked next-token distributions: no near-ties for greedy decoding to split
    source = tmp_path_factory.mktemp("mha") / "tiny"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    out = source.parent / "mla576"
    result = CliRunner().invoke(app, ["convert", str(source), "--kv-budget", "0.57", "--engine", "vllm",
                                      "--calib-text", str(corpus_file), "--calib-tokens", "512", "--calib-seq-len", "64",
                                      "--refine-steps", "0",
                                      "--eval-tokens", "0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_vllm_serves_an_mla_conversion_as_transformers_runs_it(mla_576):
    config = json.loads((mla_576 / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    prompts = [[(37 * i + 5 * p) % 380 + 2 for i in range(24)] for p in range(3)]
    request = {"model": str(mla_576), "dtype": "float32", "prompts": prompts, "new_tokens": 16, "max_model_len": 128,
               "custom_ops": ROTARY_WORKAROUND}
    served = run_worker(vllm_python(), request)
    reference = transformers_reference(mla_576, prompts, 16, torch.float32)
    found = agreement(served, reference)
    assert found["greedy_tokens_matched"] == found["greedy_tokens"], (served["tokens"], found)
    scale = max(abs(p) for row in reference["prompt_logprobs"] for p in row)  # the peaked head's log-probs reach tens
    assert found["prompt_logprob_max_diff"] <= 1e-5 * scale, (found, scale)
    assert served["kv_blocks"] > 0
