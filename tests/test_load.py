import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from attnsurg.errors import UserError
from attnsurg.io.load import load_config, load_model, resolve_device, resolve_dtype, resolve_source


def test_local_directory_loads_and_matches(tiny_checkpoints):
    source = resolve_source(str(tiny_checkpoints["qwen2"]))
    assert source.kind == "dir"
    model = load_model(source)
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen2"])
    ids = torch.arange(10)[None]
    torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_sharded_checkpoint_loads(tiny_checkpoints, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded = load_model(resolve_source(str(tmp_path / "sharded")))
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)


def test_missing_path():
    with pytest.raises(UserError, match="does not exist"):
        resolve_source("./no/such/model")


def test_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(UserError, match="not a checkpoint directory"):
        resolve_source(str(tmp_path))


def test_plain_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match="is a file, not a checkpoint"):
        resolve_source(str(tmp_path / "weights.safetensors"))


def test_unknown_name_lists_builtins():
    with pytest.raises(UserError, match="smollm2-135m"):
        resolve_source("no such model!")


def test_a_mistyped_builtin_name_is_answered_at_once_with_the_name():
    with pytest.raises(UserError, match=r"'smollm2' is not a local path or a built-in model; did you mean smollm2-135m\?"):
        resolve_source("smollm2")


def test_a_truncated_safetensors_file_is_named_before_loading(tiny_checkpoints, tmp_path):
    target = tmp_path / "truncated"
    shutil.copytree(tiny_checkpoints["llama-gqa"], target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(UserError, match=r"model.safetensors' is not a readable safetensors file .* truncated"):
        resolve_source(str(target))


def rewrite_header(weights, edit) -> None:
    """Apply ``edit`` to a safetensors file's JSON header in place, keeping the data as it is."""
    import json
    import struct

    data = weights.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size :])


@pytest.mark.parametrize("shape, dtype", [([32, 128], "F32"), ([64, 128], "F16")])  # same bytes, another shape
def test_a_header_that_lies_about_a_shape_is_named_before_loading(tiny_checkpoints, tmp_path, shape, dtype):
    target = tmp_path / "lying"
    shutil.copytree(tiny_checkpoints["llama-gqa"], target)
    name = "model.layers.0.self_attn.q_proj.weight"
    rewrite_header(target / "model.safetensors", lambda header: header[name].update(shape=shape, dtype=dtype))
    with pytest.raises(UserError, match=rf"holds '{name}' with shape \[{shape[0]}, {shape[1]}\], but its config.json needs \[64, 64\]"):
        resolve_source(str(target))


def test_an_index_naming_a_missing_shard_is_named_before_loading(tiny_checkpoints, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    shards[1].unlink()
    with pytest.raises(UserError, match=rf"names 1 shard\(s\) that are not there \({shards[1].name}\)"):
        resolve_source(str(tmp_path / "sharded"))


def _pickle_checkpoint(tiny_checkpoints, tmp_path):
    target = tmp_path / "pickled"
    target.mkdir()
    shutil.copy(tiny_checkpoints["llama-gqa"] / "config.json", target)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    torch.save(model.state_dict(), target / "pytorch_model.bin")
    return target


def test_pickle_weights_refused_without_allow_pickle(tiny_checkpoints, tmp_path):
    target = _pickle_checkpoint(tiny_checkpoints, tmp_path)
    with pytest.raises(UserError, match="--allow-pickle"):
        resolve_source(str(target))
    source = resolve_source(str(target), allow_pickle=True)
    model = load_model(source, allow_pickle=True)
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    torch.testing.assert_close(model.lm_head.weight, reference.lm_head.weight)


def test_remote_code_checkpoint_needs_the_flag(tiny_checkpoints, tmp_path):
    target = tmp_path / "remote"
    shutil.copytree(tiny_checkpoints["llama-gqa"], target)
    config = json.loads((target / "config.json").read_text())
    config.update(model_type="my_custom_llm", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="--trust-remote-code"):
        resolve_source(str(target))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import T5Config

    T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=32).save_pretrained(tmp_path)
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    source = resolve_source(str(tmp_path))
    with pytest.raises(UserError, match=r"not a causal language model.*Llama"):
        load_config(source)


IMPOSSIBLE_CONFIGS = {
    "zero heads": ({"num_attention_heads": 0}, "impossible values"),
    "heads not dividing hidden": ({"num_attention_heads": 7, "head_dim": None}, "not a multiple of the number of attention heads"),
    "zero kv heads": ({"num_key_value_heads": 0}, "num_key_value_heads is 0"),
    "kv heads not dividing heads": ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    "no layers": ({"num_hidden_layers": 0}, "num_hidden_layers is 0"),
    "empty vocabulary": ({"vocab_size": 0}, "vocab_size is 0"),
    "no attention at all": ({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}, "has no num_attention_heads"),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE_CONFIGS))
def test_a_config_no_model_can_have_is_one_line_before_any_model_is_built(tiny_checkpoints, tmp_path, case):
    changes, message = IMPOSSIBLE_CONFIGS[case]
    target = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama-gqa"], target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    if changes.get("model_type") == "mamba":
        config = {k: v for k, v in config.items() if k not in ("num_attention_heads", "num_key_value_heads", "head_dim")}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=message):
        load_config(resolve_source(str(target)))


def test_device_and_dtype_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(UserError, match="unknown dtype"):
        resolve_dtype("int3", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            resolve_device("cuda")


@pytest.mark.parametrize("architecture,message", [("bert", "not supported"), ("mamba", "has no num_attention_heads")])
def test_a_gguf_of_an_architecture_without_surgery_is_one_line(tmp_path, architecture, message):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / f"{architecture}.gguf"
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match=message):
        load_config(resolve_source(str(path)))


def test_a_hub_id_is_read_from_its_snapshot_without_pickle_weights(tiny_checkpoints, tmp_path, monkeypatch):
    """A hub model streams from its snapshot in the hub cache (config, safetensors, tokenizer: never pickle
    weights, and code only when trusted); a failed download is one line."""
    from pathlib import Path

    import attnsurg.io.load as load
    from attnsurg.errors import UserError

    asked = []

    def snapshot_download(repo_id, allow_patterns):
        asked.append((repo_id, allow_patterns))
        return str(tiny_checkpoints["llama-gqa"])

    monkeypatch.setattr(load, "snapshot_download", snapshot_download)
    hub = load.ModelSource("org/tiny", "hub", "org/tiny")
    with load.layer_readable(hub, tmp_path / "out") as readable:
        assert readable.kind == "dir" and Path(readable.path) == tiny_checkpoints["llama-gqa"]
    assert asked[0][0] == "org/tiny" and "*.safetensors" in asked[0][1]
    assert not any(p.endswith((".bin", ".py", ".pt")) for p in asked[0][1])
    load.downloaded(hub, trust_remote_code=True)
    assert "*.py" in asked[1][1]

    def offline(repo_id, allow_patterns):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore")

    monkeypatch.setattr(load, "snapshot_download", offline)
    with pytest.raises(UserError, match="cannot download 'org/tiny' from the hub .We couldn't connect"):
        load.downloaded(hub)


def test_the_layer_count_is_read_from_one_stack_of_layers():
    """The quick count compares the decoder's layers with the config; a checkpoint with a second stack (a
    vision tower) is left to the tensor-by-tensor check rather than miscounted."""
    from attnsurg.errors import UserError
    from attnsurg.io.load import check_layer_count

    decoder = {f"model.layers.{i}.self_attn.q_proj.weight": None for i in range(2)}
    check_layer_count("m", 2, decoder)
    with pytest.raises(UserError, match="naming 3 layers, but its weights hold 2"):
        check_layer_count("m", 3, decoder)
    with pytest.raises(UserError, match="holds weights of layer 1"):
        check_layer_count("m", 1, decoder)
    vision = {f"vision_tower.encoder.layers.{i}.mlp.fc1.weight": None for i in range(5)}
    check_layer_count("m", 2, {**decoder, **vision})
