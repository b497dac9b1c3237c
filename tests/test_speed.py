import json

import torch

from attnsurg.cli import app
from attnsurg.eval.speed import cache_bytes, tensors_in
from attnsurg.eval.tasks.scoring import returned_cache
from tests.conftest import build_tiny
from typer.testing import CliRunner


def test_cache_bytes_count_every_tensor_once(tokenizer):
    model = build_tiny("llama", len(tokenizer), num_key_value_heads=2)
    with torch.no_grad():
        cache = returned_cache(model(input_ids=torch.arange(10)[None], use_cache=True))
    # 2 layers x (k, v) x 2 KV heads x head dim 16 x 10 tokens x 4 bytes
    assert cache_bytes(cache) == 2 * 2 * 2 * 16 * 10 * 4
    tensor = torch.zeros(4)
    assert len(tensors_in({"a": tensor, "b": [tensor, (tensor,)]})) == 1


def test_speed_reads_the_cache_each_model_really_holds(tiny_checkpoints, corpus_file, tmp_path):
    """The converted MLA model holds its latent (and shared RoPE key) per token, as its config predicts."""
    runner = CliRunner()
    source = tiny_checkpoints["llama-gqa"]
    mla = tmp_path / "mla"
    converted = runner.invoke(app, ["convert", str(source), "--kv-budget", "0.5", "--calib-text", str(corpus_file),
                                    "--calib-tokens", "256", "--refine-steps", "0", "--eval-tokens", "0", "-o", str(mla)])
    assert converted.exit_code == 0, converted.output
    for batch in (1, 2):
        result = runner.invoke(app, ["eval", "speed", str(source), str(mla), "--context", "32,64", "--new-tokens", "4",
                                     "--repeats", "2", "--batch", str(batch), "--device", "cpu", "--json"])
        assert result.exit_code == 0, result.output
        record = json.loads(result.stdout)
        assert record["batch"] == batch
        for model in record["models"]:
            for context in model["contexts"]:
                assert context["kv_bytes_per_token"] == model["predicted_kv_bytes_per_token"]
                assert context["prefill_tokens_per_second"] > 0 and context["decode_tokens_per_second"] > 0
                assert len(context["prefill_seconds"]) == 2
        original, absorbed, stock = record["models"]  # the MLA model in both runtimes, the original once
        assert [m["runtime"] for m in record["models"]] == [None, "attnsurg", "stock"]
        assert absorbed["ratios"]["64"]["kv_cache"] == stock["ratios"]["64"]["kv_cache"] < 1.0
        assert original["ratios"]["64"]["kv_cache"] == 1.0


def test_speed_times_one_runtime_when_asked(tiny_checkpoints):
    result = CliRunner().invoke(app, ["eval", "speed", str(tiny_checkpoints["llama-gqa"]), "--context", "16",
                                      "--new-tokens", "2", "--repeats", "1", "--runtime", "stock", "--json"])
    assert result.exit_code == 0, result.output
    assert [m["runtime"] for m in json.loads(result.stdout)["models"]] == [None]
    wrong = CliRunner().invoke(app, ["eval", "speed", str(tiny_checkpoints["llama-gqa"]), "--runtime", "fast"])
    assert wrong.exit_code == 2 and "runtime" in wrong.output
