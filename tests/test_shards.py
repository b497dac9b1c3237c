import pytest
import torch
from transformers import AutoModelForCausalLM

from attnsurg.io.shards import ShardWriter


def test_tensors_added_in_any_order_make_a_checkpoint_transformers_loads(tiny_checkpoints, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen2"])
    state = {name: tensor for name, tensor in model.state_dict().items() if name != "lm_head.weight" or not model.config.tie_word_embeddings}
    with torch.device("meta"):
        planned = {name: torch.empty(t.shape, dtype=torch.bfloat16) for name, t in state.items()}
    out = tmp_path / "out"
    out.mkdir()
    writer = ShardWriter(out, planned, max_shard_size="40KB")
    order = list(reversed(state))  # the last layers first: shards fill out of order
    for i, name in enumerate(order):
        writer.add(name, state[name])
        if i == 0:
            with pytest.raises(ValueError, match="already added"):
                writer.add(name, state[name])
    written = writer.finish()
    assert len(written) > 1 and (out / "model.safetensors.index.json").is_file()
    model.config.save_pretrained(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, tensor in state.items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor.to(torch.bfloat16).float())


def test_wrong_or_missing_tensors_are_refused(tmp_path):
    with torch.device("meta"):
        planned = {"a": torch.empty(2, 3), "b": torch.empty(4)}
    writer = ShardWriter(tmp_path, planned)
    with pytest.raises(ValueError, match="shape"):
        writer.add("a", torch.zeros(3, 2))
    with pytest.raises(ValueError, match="not in the planned"):
        writer.add("c", torch.zeros(1))
    writer.add("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1 planned tensors never added"):
        writer.finish()
