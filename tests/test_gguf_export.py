"""GGUF export: the file holds what llama.cpp's loader asks for, and its tensors, read the way llama.cpp's graph
reads them, compute the checkpoint's own attention."""

import json

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.cli import app
from attnsurg.errors import UserError
from attnsurg.io.gguf_export import export_gguf
from attnsurg.calibrate import causal_mask
from attnsurg.methods.mla.conversion import convert
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.methods.mla.refine import Refinement

# What llama.cpp's DeepSeek2 loader reads (src/models/deepseek2.cpp and llama-model.cpp in the llama-cpp-python
# 0.3.36 source distribution): required keys, and per block the tensors of a dense MLA layer with no q LoRA.
DEEPSEEK2_KEYS = [
    "general.architecture", "deepseek2.block_count", "deepseek2.context_length", "deepseek2.embedding_length",
    "deepseek2.feed_forward_length", "deepseek2.attention.head_count", "deepseek2.attention.layer_norm_rms_epsilon",
    "deepseek2.attention.q_lora_rank", "deepseek2.attention.kv_lora_rank", "deepseek2.expert_feed_forward_length",
    "deepseek2.expert_shared_count", "deepseek2.leading_dense_block_count", "deepseek2.rope.dimension_count",
    "deepseek2.attention.key_length_mla", "deepseek2.attention.value_length_mla", "tokenizer.ggml.model",
    "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
]
DEEPSEEK2_BLOCK = ["attn_norm", "attn_q", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output",
                   "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
LLAMA_BLOCK = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]


@pytest.fixture(scope="module")
def mla_checkpoint(tiny_checkpoints, tmp_path_factory):
    source = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    windows = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(0))
    mla = convert(source, family_for_surgery("llama"), windows, plan_mla(inspect_config(source.config), kv_budget=0.5),
                  refinement=Refinement(5)).model
    path = tmp_path_factory.mktemp("mla") / "native"
    mla.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tiny_checkpoints["llama-gqa"] / name).read_bytes())
    return path


def read(path):
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    return fields, tensors


def rope_adjacent_pairs(x: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's normal RoPE: pairs (2i, 2i + 1) rotate at base^(-2i/n) by the position ([L, ..., n])."""
    n = x.shape[-1]
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * base ** (-torch.arange(0, n, 2, dtype=torch.float64) / n)
    angles = angles.view(x.shape[0], *([1] * (x.ndim - 2)), n // 2)
    even, odd = x[..., 0::2].double(), x[..., 1::2].double()
    rotated = torch.stack([even * angles.cos() - odd * angles.sin(), even * angles.sin() + odd * angles.cos()], -1)
    return rotated.flatten(-2).to(x.dtype)


def attention(q, k, v, scale):
    """Causal softmax attention per head: q [L, H, n], k [L, H, n], v [L, H, m] -> [L, H, m]."""
    scores = torch.einsum("qhn,khn->hqk", q, k) * scale + causal_mask(q.shape[0])[0]
    return torch.einsum("hqk,khm->qhm", scores.softmax(-1), v)


def deepseek2_layer_attention(fields, tensors, x: torch.Tensor, block: int) -> torch.Tensor:
    """Layer ``block``'s attention as llama.cpp's DeepSeek2 graph computes it in the latent space: the no-RoPE
    query absorbed through attn_k_b, scores against the normalised latent, the latent mixture expanded by attn_v_b."""
    t = {name.split(".")[2]: torch.from_numpy(a.astype(np.float32)) for name, a in tensors.items()
         if name.startswith(f"blk.{block}.")}
    H, rank = fields["deepseek2.attention.head_count"], fields["deepseek2.attention.kv_lora_rank"]
    R, k_mla = fields["deepseek2.rope.dimension_count"], fields["deepseek2.attention.key_length_mla"]
    base, eps = fields["deepseek2.rope.freq_base"], fields["deepseek2.attention.layer_norm_rms_epsilon"]
    L = x.shape[0]
    q = (x @ t["attn_q"].T).view(L, H, k_mla)
    q_nope, q_pe = q.split([k_mla - R, R], -1)
    kv = x @ t["attn_kv_a_mqa"].T
    latent, k_pe = kv.split([rank, R], -1)
    latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps) * t["attn_kv_a_norm"]
    q_latent = torch.einsum("hrn,lhn->lhr", t["attn_k_b"], q_nope)  # k_b: [H, rank, nope]
    keys = torch.cat([latent[:, None].expand(L, H, rank), rope_adjacent_pairs(k_pe, base)[:, None].expand(L, H, R)], -1)
    queries = torch.cat([q_latent, rope_adjacent_pairs(q_pe, base)], -1)
    mixed = attention(queries, keys, latent[:, None].expand(L, H, rank), k_mla**-0.5)
    heads = torch.einsum("hvr,lhr->lhv", t["attn_v_b"], mixed)  # v_b: [H, v, rank]
    return heads.reshape(L, -1) @ t["attn_output"].T


def test_mla_gguf_has_what_llama_cpp_loads_and_computes_the_same_attention(mla_checkpoint, tmp_path):
    result = export_gguf(str(mla_checkpoint), tmp_path / "m.gguf", tokenizer_pre="gpt-2")
    fields, tensors = read(result.path)
    config = json.loads((mla_checkpoint / "config.json").read_text())
    assert fields["general.architecture"] == "deepseek2" and result.architecture == "deepseek2"
    assert all(key in fields for key in DEEPSEEK2_KEYS), [k for k in DEEPSEEK2_KEYS if k not in fields]
    assert fields["deepseek2.attention.q_lora_rank"] == 0 and fields["deepseek2.expert_count"] == 0
    assert fields["deepseek2.leading_dense_block_count"] == config["num_hidden_layers"]
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(config["num_hidden_layers"]) for n in DEEPSEEK2_BLOCK}
    assert set(tensors) == expected  # llama.cpp refuses a file with any tensor more or less
    H, rank, nope = config["num_attention_heads"], config["kv_lora_rank"], config["qk_nope_head_dim"]
    assert tensors["blk.0.attn_k_b.weight"].shape == (H, rank, nope)
    assert tensors["blk.0.attn_v_b.weight"].shape == (H, config["v_head_dim"], rank)
    assert len(fields["tokenizer.ggml.tokens"]) == config["vocab_size"]

    model = AutoModelForCausalLM.from_pretrained(mla_checkpoint)
    x = torch.randn(1, 24, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    layer = model.model.layers[1].self_attn
    rope = model.model.rotary_emb(x, torch.arange(24)[None])
    with torch.no_grad():
        reference = layer(hidden_states=x, position_embeddings=rope, attention_mask=causal_mask(24))[0][0]
    torch.testing.assert_close(deepseek2_layer_attention(fields, tensors, x[0], 1), reference, rtol=1e-4, atol=1e-5)


def test_llama_gguf_permutes_q_and_k_to_adjacent_rope_pairs(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama-gqa"]
    fields, tensors = read(export_gguf(str(path), tmp_path / "l.gguf", tokenizer_pre="gpt-2").path)
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert fields["general.architecture"] == "llama" and fields["llama.attention.head_count_kv"] == 2
    assert set(tensors) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(config.num_hidden_layers) for n in LLAMA_BLOCK}
    t = {name.split(".")[2]: torch.from_numpy(a.astype(np.float32)) for name, a in tensors.items() if name.startswith("blk.0.")}
    H, G, d, L = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 24
    x = torch.randn(L, config.hidden_size, generator=torch.Generator().manual_seed(0))
    base = fields["llama.rope.freq_base"]
    q = rope_adjacent_pairs((x @ t["attn_q"].T).view(L, H, d), base)
    k = rope_adjacent_pairs((x @ t["attn_k"].T).view(L, G, d), base).repeat_interleave(H // G, 1)
    v = (x @ t["attn_v"].T).view(L, G, d).repeat_interleave(H // G, 1)
    ours = attention(q, k, v, d**-0.5).reshape(L, -1) @ t["attn_output"].T
    layer = model.model.layers[0].self_attn
    with torch.no_grad():
        rope = model.model.rotary_emb(x[None], torch.arange(L)[None])
        reference = layer(hidden_states=x[None], position_embeddings=rope, attention_mask=causal_mask(L))[0][0]
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)


def test_tied_embeddings_write_no_output_tensor_and_dtypes_follow_the_request(tiny_checkpoints, tmp_path):
    _, tensors = read(export_gguf(str(tiny_checkpoints["llama-mha"]), tmp_path / "t.gguf", "f16", "gpt-2").path)
    assert "output.weight" not in tensors
    assert tensors["blk.0.attn_q.weight"].dtype == np.float16 and tensors["blk.0.attn_norm.weight"].dtype == np.float32


@pytest.mark.parametrize("variant,fragment", [("qwen2", "this one is 'qwen2'"), ("exact", "--format native")])
def test_refusals_are_one_line(variant, fragment, tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["qwen2"]
    if variant == "exact":
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
        plan = plan_mla(inspect_config(model.config), kv_budget=0.5, format="exact")
        windows = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(0))
        source = tmp_path / "exact"
        convert(model, family_for_surgery("llama"), windows, plan).model.save_pretrained(source)
    result = CliRunner().invoke(app, ["export", str(source), "--gguf", str(tmp_path / "x.gguf"), "--tokenizer-pre", "gpt-2"])
    assert result.exit_code == 2 and fragment in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*partial"))


def test_an_existing_file_is_kept_without_overwrite_and_unknown_tokenizers_are_named(tiny_checkpoints, tmp_path):
    target = tmp_path / "m.gguf"
    target.write_text("mine")
    with pytest.raises(UserError, match="--overwrite"):
        export_gguf(str(tiny_checkpoints["llama-gqa"]), target, tokenizer_pre="gpt-2")
    assert target.read_text() == "mine"
    with pytest.raises(UserError, match="--tokenizer-pre"):
        export_gguf(str(tiny_checkpoints["llama-gqa"]), tmp_path / "n.gguf")
