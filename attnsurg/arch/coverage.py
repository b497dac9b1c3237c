"""The support matrix: each family users bring, as transformers' own config class builds it (tiny sizes, the
family's real attention features), against every registered method: what a full budget gives, or why the
method refuses it. Generated from the registry, never written by hand."""

from __future__ import annotations

from collections.abc import Callable

from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from attnsurg.arch.anatomy import inspect_config

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}

FAMILY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "Llama 2 / SmolLM (llama)": lambda: LlamaConfig(**SMALL, head_dim=16),
    "Llama 3.x (llama3 RoPE scaling)": lambda: LlamaConfig(**SMALL, head_dim=16, max_position_embeddings=4096,
                                                           rope_parameters=LLAMA3_ROPE),
    "Mistral": lambda: MistralConfig(**SMALL, head_dim=16, sliding_window=None),
    "Qwen2 / Qwen2.5 (q/k/v biases)": lambda: Qwen2Config(**SMALL),
    "Qwen3 (q/k norms)": lambda: Qwen3Config(**SMALL, head_dim=16),
    "Gemma 2 (sliding layers, soft-capping)": lambda: Gemma2Config(**SMALL, head_dim=16),
    "Gemma 3 (q/k norms, sliding layers)": lambda: Gemma3TextConfig(**SMALL, head_dim=16),
    "Phi-3 (fused qkv)": lambda: Phi3Config(**SMALL),
}


def support_matrix() -> dict[str, dict[str, str]]:
    """Family -> method -> what a full budget gives ("exact", or how it is fitted), or "refused: why"."""
    from attnsurg.methods import registered_methods

    matrix = {}
    for family, make in FAMILY_CONFIGS.items():
        anatomy = inspect_config(make())
        matrix[family] = {name: (f"refused: {reason}" if (reason := spec.unsupported_reason(anatomy)) else spec.full_budget_for(anatomy))
                          for name, spec in registered_methods().items()}
    return matrix
