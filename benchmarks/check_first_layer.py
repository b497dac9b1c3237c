"""Load the first decoder layer (with the embeddings, final norm and head) of a converted checkpoint too large for
memory into a one-layer stock transformers model and run it. Usage: python benchmarks/check_first_layer.py OUT"""
import json, sys
from pathlib import Path
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

out = Path(sys.argv[1])
config = AutoConfig.from_pretrained(out)
print(type(config).__name__, "layers", config.num_hidden_layers, "kv_lora_rank", config.kv_lora_rank,
      "rope", config.qk_rope_head_dim, "nope", config.qk_nope_head_dim, "dtype", config.dtype)
weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
print("tensors", len(weight_map), "shards", len(set(weight_map.values())),
      "GB", sum(p.stat().st_size for p in out.glob("*.safetensors")) / 1e9)
config.num_hidden_layers = 1
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
keep = {name for name in model.state_dict()}
state = {}
for name in keep:
    file = weight_map.get(name) or weight_map.get(name.replace("lm_head", "model.embed_tokens"))
    with safe_open(str(out / file), framework="pt") as f:
        state[name] = f.get_tensor(name if name in weight_map else name.replace("lm_head", "model.embed_tokens"))
model.load_state_dict(state, strict=True)
ids = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    logits = model(ids).logits
print("layer 0 + head: logits", tuple(logits.shape), "finite", bool(torch.isfinite(logits).all()))
for i in range(json.loads((out / "config.json").read_text())["num_hidden_layers"]):
    names = [n for n in weight_map if n.startswith(f"model.layers.{i}.")]
    assert len(names) == len([n for n in keep if n.startswith("model.layers.0.")]), (i, len(names))
print("every layer has", len(names), "tensors")
