import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from attnsurg.errors import UserError
from attnsurg.io.shards import INDEX_FILE, ShardWriter


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


def planned_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return {name: torch.empty(t.shape, dtype=t.dtype) for name, t in tensors.items()}


def test_tensors_go_straight_into_the_file_safetensors_would_write(tmp_path):
    """Each tensor is written into its byte range on arrival (nothing waits in memory), and the file is the one
    ``safetensors`` writes from the whole dict, byte for byte."""
    tensors = {"b.weight": torch.randn(5, 3).to(torch.bfloat16), "a.bias": torch.randn(7), "c": torch.arange(6),
               "flag": torch.tensor([True, False])}
    (tmp_path / "direct").mkdir()
    writer = ShardWriter(tmp_path / "direct", planned_like(tensors))
    for name in ["c", "b.weight", "flag", "a.bias"]:
        writer.add(name, tensors[name])
        assert writer.progress()[2] == {}  # nothing held back
    assert writer.finish() == ["model.safetensors"]
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "direct" / "model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_a_shard_being_filled_is_resumed_in_place(tmp_path):
    """A writer stopped halfway through a shard leaves the tensors in place; a new writer restored from its
    progress reopens the file and fills the rest; a file that is not the planned shard is refused."""
    tensors = {f"t{i}": torch.randn(64, 64) for i in range(6)}
    planned = planned_like(tensors)
    first = ShardWriter(tmp_path, planned, max_shard_size="40KB")
    for name in ["t0", "t1", "t4"]:
        first.add(name, tensors[name])
    first.sync()
    written, filling, pending = first.progress()
    assert filling and not pending
    first.close()
    second = ShardWriter(tmp_path, planned, max_shard_size="40KB")
    second.restore(written, filling, pending)
    for name in ["t2", "t3", "t5"]:
        second.add(name, tensors[name])
    with pytest.raises(ValueError, match="already added"):
        second.add("t1", tensors["t1"])
    second.finish()
    with open(tmp_path / INDEX_FILE) as f:
        weight_map = json.load(f)["weight_map"]
    for name, tensor in tensors.items():
        with safe_open(str(tmp_path / weight_map[name]), framework="pt") as f:
            assert torch.equal(f.get_tensor(name), tensor)
    other = {name: torch.empty(128, 32, device="meta") for name in tensors}  # same bytes, other shapes
    with pytest.raises(UserError, match="not the shard this run writes"):
        ShardWriter(tmp_path, other, max_shard_size="40KB").restore([], filling, {})
