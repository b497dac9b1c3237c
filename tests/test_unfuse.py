"""Phi-3's fused projections split on load: the same logits, so every method operates on it."""

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM
from typer.testing import CliRunner

from attnsurg.arch.unfuse import unfused_model
from attnsurg.cli import app
from attnsurg.io.load import load_model, resolve_source

TINY_PHI3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=384, pad_token_id=0, eos_token_id=0, bos_token_id=0)
LONGROPE = {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1 + 0.1 * i for i in range(8)],
                                "long_factor": [2 + 0.1 * i for i in range(8)]},
            "original_max_position_embeddings": 32, "max_position_embeddings": 128}


def tiny_phi3(**overrides) -> Phi3ForCausalLM:
    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**TINY_PHI3, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("qkv_proj.weight"):
                p.mul_(4.0)  # attention far from uniform
    return model


@pytest.mark.parametrize("overrides", [{}, LONGROPE, {"sliding_window": 16}, {"tie_word_embeddings": True}],
                         ids=["default", "longrope", "sliding", "tied"])
def test_split_projections_give_the_same_logits(overrides):
    model = tiny_phi3(**overrides)
    split = unfused_model(model)
    assert split.config.model_type == "mistral" and hasattr(split.model.layers[0].self_attn, "q_proj")
    ids = torch.randint(0, 384, (1, 60), generator=torch.Generator().manual_seed(1))  # past the original context
    with torch.no_grad():
        assert torch.equal(split(ids).logits, model(ids).logits)


@pytest.fixture(scope="module")
def phi3_checkpoint(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("phi3") / "tiny-phi3"
    tiny_phi3().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("args", [
    ["compress", "--method", "svdllm", "--targets", "k,v", "--kv-latent", "--rank", "64"],  # 64: the full 2 G d
    ["convert", "--to", "mla", "--kv-budget", "1.0", "--format", "exact", "--rope-layout", "flexible", "--refine-steps", "0"],
], ids=["svdllm", "mla-exact"])
def test_full_budget_on_phi3_reproduces_its_logits(phi3_checkpoint, corpus_file, tmp_path, args):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [*args[:1], str(phi3_checkpoint), *args[1:], "--calib-text", str(corpus_file),
                                      "--calib-tokens", "512", "--calib-seq-len", "64", "--eval-tokens", "0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    ids = torch.randint(0, 384, (1, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        written = load_model(resolve_source(str(out)))(ids).logits
        torch.testing.assert_close(written, load_model(resolve_source(str(phi3_checkpoint)))(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("args", [
    ["compress", "--method", "svdllm", "--targets", "q,k,v,o", "--ratio", "0.5"],
    ["convert", "--to", "mla", "--kv-budget", "0.5", "--refine-steps", "3", "--refine-tokens", "256"],
], ids=["svdllm", "mla"])
def test_a_fused_family_streams_to_the_checkpoint_a_whole_load_writes(phi3_checkpoint, corpus_file, tmp_path, args):
    """Streaming reads Phi-3's fused tensors split (``UnfusedReader``), layer by layer: the same checkpoint as
    splitting the loaded model, without loading it."""
    import json

    from safetensors import safe_open

    common = [*args[:1], str(phi3_checkpoint), *args[1:], "--calib-text", str(corpus_file), "--calib-tokens", "512",
              "--calib-seq-len", "64", "--eval-tokens", "0", "--json"]
    for name, extra in (("loaded", ["--no-stream"]), ("streamed", [])):
        result = CliRunner().invoke(app, common + extra + ["-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["streamed"] == (name == "streamed")
    tensors = {}
    for name in ("loaded", "streamed"):
        with safe_open(tmp_path / name / "model.safetensors", "pt") as f:
            tensors[name] = {key: f.get_tensor(key) for key in f.keys()}
    assert tensors["streamed"].keys() == tensors["loaded"].keys()
    for key, tensor in tensors["loaded"].items():
        torch.testing.assert_close(tensors["streamed"][key], tensor, rtol=1e-4, atol=1e-5, msg=key)
