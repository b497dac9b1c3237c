import pytest
from transformers import AutoConfig, DeepseekV3Config, LlamaConfig

from attnsurg.arch import family_for_surgery, inspect_config
from attnsurg.errors import UserError

from conftest import tiny_config


def test_gqa_llama(tiny_checkpoints):
    a = inspect_config(AutoConfig.from_pretrained(tiny_checkpoints["llama-gqa"]))
    assert (a.family, a.attention_kind, a.num_heads, a.num_kv_heads, a.head_dim) == ("llama", "gqa", 4, 2, 16)
    assert a.kv_values_per_layer == 2 * 2 * 16
    assert a.kv_bytes_per_token() == 2 * 64 * 4 and a.kv_bytes_per_token("bfloat16") == 2 * 64 * 2
    assert not (a.q_bias or a.k_bias or a.v_bias or a.o_bias or a.qk_norm)
    # q (64x64) + k, v (32x64 each) + o (64x64) per layer
    assert a.attention_parameters == 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64)


def test_mha_with_tied_embeddings_counts_shared_weights_once(tiny_checkpoints):
    a = inspect_config(AutoConfig.from_pretrained(tiny_checkpoints["llama-mha"]))
    assert a.attention_kind == "mha" and a.tied_embeddings
    untied = inspect_config(AutoConfig.from_pretrained(tiny_checkpoints["llama-gqa"]))
    vocab = 384
    assert untied.total_parameters - a.total_parameters == vocab * 64 - 2 * (2 * 32 * 64)


def test_qwen2_has_qkv_biases_but_no_output_bias(tiny_checkpoints):
    a = inspect_config(AutoConfig.from_pretrained(tiny_checkpoints["qwen2"]))
    assert (a.q_bias, a.k_bias, a.v_bias, a.o_bias) == (True, True, True, False)


def test_rope_and_sliding_window_are_read():
    config = tiny_config("mistral", 100, num_key_value_heads=1, rope_theta=5e5)
    config.sliding_window = 32
    a = inspect_config(config)
    assert a.attention_kind == "mqa" and a.rope_theta == 5e5 and a.rope_type == "default"
    assert a.sliding_window == 32 and a.sliding_layers == 2


def test_llama3_rope_type():
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128}
    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=50,
                         rope_parameters=rope)
    assert inspect_config(config).rope_type == "llama3"


def test_mla_anatomy_caches_latent_plus_rope_key():
    config = DeepseekV3Config(
        vocab_size=100, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
        n_group=1, topk_group=1,
    )
    a = inspect_config(config)
    assert a.attention_kind == "mla" and a.kv_values_per_layer == 24 + 8 and a.family == "deepseek_v3"


def test_surgery_families_and_the_error_that_names_them():
    assert family_for_surgery("qwen2").q_proj == "q_proj"
    with pytest.raises(UserError, match=r"not supported.*Llama / SmolLM \(llama\), Mistral \(mistral\), Qwen2 \(qwen2\)"):
        family_for_surgery("gemma3")
