import pytest
import torch
from transformers import AutoModelForCausalLM

from attnsurg.errors import UserError
from attnsurg.io.lazy import CheckpointReader, execution_device, load_layer, offloaded_model, offloaded_modules


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2", "mistral"])
def test_a_layer_read_alone_is_the_full_models_layer(variant, tiny_checkpoints, tmp_path):
    """Sharded so a layer's tensors sit in several files; the layer built from them computes what the loaded
    model's layer computes, and nothing else of the model is read."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[variant])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    reader = CheckpointReader(tmp_path / "sharded")
    assert len(set(reader.weight_map.values())) > 1
    x = torch.randn(2, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    rope = model.model.rotary_emb(x, torch.arange(12)[None])
    mask = torch.zeros(1, 1, 12, 12).masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    for index in range(model.config.num_hidden_layers):
        layer = load_layer(reader, model.config, index)
        assert next(layer.parameters()).dtype == torch.float32
        with torch.no_grad():
            expected = model.model.layers[index](x, attention_mask=mask, position_embeddings=rope)
            got = layer(x, attention_mask=mask, position_embeddings=rope)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(reader.tensor("model.norm.weight"), model.model.norm.weight.detach())


def test_reading_what_is_not_there_says_so(tiny_checkpoints, tmp_path):
    reader = CheckpointReader(tiny_checkpoints["llama-gqa"])
    with pytest.raises(UserError, match="has no tensor 'model.nothing'"):
        reader.tensor("model.nothing")
    with pytest.raises(UserError, match="no safetensors weights"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("variant, window", [("qwen2", None), ("mistral", 6)])
def test_streamed_statistics_equal_the_loaded_models(variant, window, tiny_checkpoints, tmp_path):
    """Mistral with a window shorter than the calibration windows: each streamed layer sees only its window too."""
    from attnsurg.arch.families import family_for_surgery
    from attnsurg.calibrate import input_statistics
    from attnsurg.calibrate import streamed_input_statistics

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[variant])
    if window is not None:
        model.config.sliding_window = window
        model.save_pretrained(tmp_path / "windowed")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "windowed")
    family = family_for_surgery(variant)
    windows = torch.randint(0, model.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    attentions = [layer.self_attn for layer in model.model.layers]
    loaded = input_statistics(model, attentions + [a.o_proj for a in attentions], windows)
    checkpoint = tiny_checkpoints[variant] if window is None else tmp_path / "windowed"
    streamed = streamed_input_statistics(CheckpointReader(checkpoint), model.config, family, windows)
    layers = model.config.num_hidden_layers
    for index, (attention, o_proj) in enumerate(streamed):
        torch.testing.assert_close(attention.sigma, loaded[index].sigma, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(attention.sigma_first, loaded[index].sigma_first, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o_proj.sigma, loaded[layers + index].sigma, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2", "llama-mha"])
def test_an_offloaded_model_computes_the_loaded_ones_logits_in_float32(variant, tiny_checkpoints, tmp_path):
    """Stored in bfloat16 and sharded: every decoder layer, the embeddings and the head are read from the shards
    on each forward, in float32, and dropped after it; the logits are the float32 model's. llama-mha ties its
    head to the embeddings, so the head is not stored and is read from the embeddings' table."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[variant], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16", max_shard_size="40KB")
    stored = CheckpointReader(tmp_path / "bf16").weight_map
    assert ("lm_head.weight" in stored) == (not model.config.tie_word_embeddings)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    offloaded = offloaded_model(tmp_path / "bf16")
    assert set(offloaded_modules(offloaded)) == {f"model.layers.{i}" for i in range(loaded.config.num_hidden_layers)} | {
        "model.embed_tokens", "lm_head"}
    ids = torch.randint(0, loaded.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = offloaded(ids).logits
        torch.testing.assert_close(got, loaded(ids).logits, rtol=0, atol=0)
    assert got.dtype == torch.float32 and execution_device(offloaded) == torch.device("cpu")
    assert all(p.device.type == "meta" for p in offloaded.model.layers.parameters())


def test_a_checkpoint_that_fits_is_scored_loaded_whole_and_one_that_does_not_is_offloaded(tiny_checkpoints, monkeypatch):
    """``scoring_model``: the same logits either way; loaded whole (no disk read per forward) when it fits in a
    share of the free memory, a module at a time when it does not."""
    import attnsurg.io.lazy as lazy

    path = tiny_checkpoints["llama-gqa"]
    whole = lazy.scoring_model(path)
    monkeypatch.setattr(lazy, "IN_MEMORY_SHARE", 0.0)
    offloaded = lazy.scoring_model(path)
    assert not hasattr(whole, lazy.OFFLOADED) and hasattr(offloaded, lazy.OFFLOADED)
    assert lazy.float32_bytes(CheckpointReader(path)) == 4 * sum(p.numel() for p in whole.parameters())
    ids = torch.randint(0, whole.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, whole(ids).logits, rtol=0, atol=0)
