"""Random checkpoints with the exact configs of real models, for timing and memory at real shapes.

    python benchmarks/synthetic_checkpoint.py llama-3.1-8b|llama-3.1-70b|llama-3.2-1b|qwen2.5-7b [-o out/synthetic/llama-3.1-8b] [--dtype bfloat16]
                                              [--layers N] [--shard-size 2GB]

Written tensor by tensor (each straight into its shard file, through attnsurg's ShardWriter), so an 8B
checkpoint needs little memory, not 16 GB. The weights are random (normal, std 0.02; norms 1), the
tokenizer is the demo model's (its ids fit every vocabulary here): what is measured on them is cost (time,
memory, size), never quality. ``--layers`` keeps the first N layers of the config for a quick run.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

from attnsurg.io.shards import ShardWriter

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

CONFIGS: dict[str, PretrainedConfig] = {
    # meta-llama/Llama-3.2-1B config.json
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 32.0}, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001,
    ),
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 8.0}, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001,
    ),
    # meta-llama/Llama-3.1-70B config.json
    "llama-3.1-70b": LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 8.0}, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001,
    ),
    # Qwen/Qwen2.5-7B config.json (q/k/v biases, RoPE theta 1e6)
    "qwen2.5-7b": Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        use_sliding_window=False, bos_token_id=151643, eos_token_id=151643,
    ),
}


def config_for(name: str, layers: int | None, dtype: torch.dtype) -> PretrainedConfig:
    settings = CONFIGS[name].to_dict()
    if layers:
        settings["num_hidden_layers"] = layers
        if settings.get("layer_types"):
            settings["layer_types"] = settings["layer_types"][:layers]
    settings["dtype"] = str(dtype).removeprefix("torch.")
    return CONFIGS[name].__class__.from_dict(settings)


def parameter_shapes(config: PretrainedConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as meta tensors (no memory): names and shapes from transformers itself."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def random_tensor(name: str, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(like.shape, dtype=like.dtype)
    if name.endswith(".bias"):
        return torch.zeros(like.shape, dtype=like.dtype)
    return (torch.randn(like.shape, generator=generator) * 0.02).to(like.dtype)


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_checkpoint(name: str, output: Path, dtype: torch.dtype, layers: int | None, shard_size: str) -> Path:
    from attnsurg.io.assets import ensure_demo_model

    config = config_for(name, layers, dtype)
    shapes = parameter_shapes(config, dtype)
    output.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(output, shapes, shard_size)
    generator = torch.Generator().manual_seed(0)
    for names in writer.members.values():
        for name in sorted(names):
            writer.add(name, random_tensor(name, shapes[name], generator))
    for shard in writer.finish():
        (output / shard).chmod(0o666 & ~umask())  # safetensors writes 0600
    config.save_pretrained(output)
    demo = ensure_demo_model("smollm2-135m")
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (demo / tokenizer_file).is_file():
            shutil.copy(demo / tokenizer_file, output / tokenizer_file)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(CONFIGS))
    parser.add_argument("-o", "--output", type=Path, default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument("--shard-size", default="2GB")
    args = parser.parse_args()
    output = args.output or Path("out/synthetic") / (args.name + (f"-{args.layers}l" if args.layers else ""))
    path = write_checkpoint(args.name, output, getattr(torch, args.dtype), args.layers, args.shard_size)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
    print(f"wrote {path}: {size:.2f} GB of {args.dtype} weights")


if __name__ == "__main__":
    main()
