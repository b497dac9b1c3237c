"""The synthetic checkpoints of benchmarks/ have their models' exact shapes (parameter counts as published)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

spec = importlib.util.spec_from_file_location("synthetic_checkpoint",
                                              Path(__file__).parent.parent / "benchmarks" / "synthetic_checkpoint.py")
synthetic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(synthetic)


@pytest.mark.parametrize("name,parameters", [("llama-3.2-1b", 1_235_814_400), ("llama-3.1-8b", 8_030_261_248),
                                             ("qwen2.5-7b", 7_615_616_512), ("llama-3.1-70b", 70_553_706_496)])
def test_configs_have_the_published_parameter_counts(name, parameters):
    shapes = synthetic.parameter_shapes(synthetic.config_for(name, None, torch.bfloat16), torch.bfloat16)
    assert sum(t.numel() for t in shapes.values()) == parameters


def test_a_written_checkpoint_loads_with_its_shapes(tmp_path, monkeypatch):
    """Shrunk (two layers, small vocabulary and widths) so the test writes kilobytes; sharded like the real ones."""
    import attnsurg.io.assets

    settings = {**synthetic.CONFIGS["qwen2.5-7b"].to_dict(), "vocab_size": 64, "hidden_size": 56,
                "intermediate_size": 32, "num_attention_heads": 7, "num_key_value_heads": 1}
    config = synthetic.CONFIGS["qwen2.5-7b"].__class__.from_dict(settings)
    monkeypatch.setitem(synthetic.CONFIGS, "tiny", config)
    monkeypatch.setattr(attnsurg.io.assets, "ensure_demo_model", lambda name: tmp_path / "no-demo")
    path = synthetic.write_checkpoint("tiny", tmp_path / "out", torch.bfloat16, 2, "20KB")
    assert (path / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.bfloat16
    assert model.model.layers[1].self_attn.q_proj.bias is not None
    assert torch.equal(model.model.norm.weight, torch.ones(56, dtype=torch.bfloat16))
