"""``attnsurg export MODEL --gguf OUT.gguf``: a checkpoint as the GGUF file llama.cpp loads.

Two kinds of checkpoint are written:
- an MLA conversion in the native format (``model_type: deepseek_v3``, every layer dense) as llama.cpp's
  ``deepseek2`` architecture: the MQA view of the latent (one KV head of width kv_lora_rank + RoPE dims),
  ``kv_b_proj`` split into per-head ``attn_k_b`` (transposed) and ``attn_v_b`` so llama.cpp attends in the
  latent space, ``q_lora_rank`` 0 for a plain q projection;
- an unmodified Llama or Mistral checkpoint as ``llama`` (q and k rows permuted from Hugging Face's
  half-split RoPE layout to llama.cpp's interleaved pairs), so the same command makes the baseline.

Names and keys come from the ``gguf`` package (``get_tensor_name_map``, ``GGUFWriter.add_*``). Tensors are
read one at a time from the safetensors shards; 1-D tensors (norms) stay float32, as llama.cpp's own
converter keeps them. The tokenizer is written as a GPT-2 style BPE vocabulary from ``tokenizer.json``; the
pre-tokenizer name llama.cpp needs is found the way its converter finds it (a hash of a fixed text's token
ids), or given with ``--tokenizer-pre``.
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from attnsurg.errors import UserError
from attnsurg.io.load import ModelSource, resolve_source
from attnsurg import __version__
from attnsurg.io.guard import GGUF_MARK, check_output_file
from attnsurg.io.lazy import require_finite
from attnsurg.io.load import check_checkpoint_tensors
from attnsurg.io.save import current_umask, refused_writes

DTYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
          "bf16": gguf.GGMLQuantizationType.BF16}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16}
ARCHITECTURES = {"deepseek2": gguf.MODEL_ARCH.DEEPSEEK2, "llama": gguf.MODEL_ARCH.LLAMA}
SOURCE_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}

# llama.cpp's pre-tokenizer check: the token ids of this text, hashed (conversion/base.py, get_vocab_base_pre).
PRE_TOKENIZER_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 "
    "333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= "
    "нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure "
    "I'll make it, 'D you like some tea? We'Ve a'lL"
)
# The hashes of the families attnsurg operates on, from llama.cpp's table (the names its vocab loader knows).
KNOWN_PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM / SmolLM2
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen 1.5 / 2 / 2.5
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen 3
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}
PRE_TOKENIZER_NAMES = sorted(set(KNOWN_PRE_TOKENIZERS.values()))
# Every BPE pre-tokenizer name llama.cpp's vocabulary loader knows (src/llama-vocab.cpp); any other name makes
# it warn and tokenize with its default pre-tokenizer, so the GGUF would read text differently from the model.
LLAMA_CPP_PRE_TOKENIZERS = frozenset("""
    default llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 deepseek-llm deepseek-coder deepseek-v3
    falcon mpt starcoder gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum jina-v1-en
    jina-v2-code roberta-bpe refact command-r qwen2 deepseek-r1-qwen kormo stablelm2 olmo dbrx smaug-bpe poro-chat
    glm4 chatglm-bpe viking jais tekken smollm codeshell bloom gpt3-finnish exaone exaone4 chameleon minerva-7b
    megrez gpt-4o llama4 superbpe trillion granite-docling bailingmoe bailingmoe2 llada-moe seed-coder hunyuan
    hunyuan-dense kimi-k2 grok-2 afmoe minimax-m2""".split())


@dataclass
class GGUFExport:
    path: Path
    architecture: str
    tensors: int
    bytes: int


# ---------------------------------------------------------------------------------------- checks
def export_architecture(config: dict) -> str:
    """The llama.cpp architecture a checkpoint is written as, or a UserError saying why it cannot be."""
    model_type = config.get("model_type")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if model_type == "deepseek_v3":
        if config.get("attention_bias"):
            raise UserError("this MLA checkpoint is in the exact format, whose attention biases llama.cpp's DeepSeek2 "
                            "graph does not have; convert with --format native to export it")
        if config.get("first_k_dense_replace", 0) < config["num_hidden_layers"]:
            raise UserError("this DeepseekV3 checkpoint has mixture-of-experts layers; export writes dense ones only "
                            "(use llama.cpp's convert_hf_to_gguf.py)")
        if rope_type != "default":
            raise UserError(f"RoPE type '{rope_type}' has no DeepSeek2 form in llama.cpp; convert with "
                            "--rope-layout standard to export it")
        return "deepseek2"
    if model_type in ("llama", "mistral"):
        if rope_type != "default":
            raise UserError(f"RoPE type '{rope_type}' is not written by attnsurg export yet; only plain RoPE")
        if model_type == "mistral" and config.get("sliding_window"):
            raise UserError("llama.cpp's llama graph has no sliding window; this Mistral checkpoint needs one")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise UserError("biases in attention or MLP projections are not written by attnsurg export yet")
        return "llama"
    raise UserError(f"export writes MLA conversions (deepseek_v3) and unmodified Llama/Mistral checkpoints; "
                    f"this one is '{model_type}'")


def checked_pre_tokenizer(name: str) -> str:
    if name not in LLAMA_CPP_PRE_TOKENIZERS:
        close = difflib.get_close_matches(name, sorted(LLAMA_CPP_PRE_TOKENIZERS), n=1)
        hint = f"did you mean {close[0]}?" if close else f"for example {', '.join(PRE_TOKENIZER_NAMES)}"
        raise UserError(f"--tokenizer-pre: '{name}' is not a pre-tokenizer llama.cpp knows (it would tokenize with its "
                        f"default one); {hint}")
    return name


def pre_tokenizer_of(tokenizer_dir: Path) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer, found from the hash its converter uses."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    digest = sha256(str(tokenizer.encode(PRE_TOKENIZER_TEXT)).encode()).hexdigest()
    if digest not in KNOWN_PRE_TOKENIZERS:
        raise UserError("the tokenizer's pre-tokenizer is not one attnsurg recognises; pass --tokenizer-pre with "
                        f"llama.cpp's name for it (for example {', '.join(PRE_TOKENIZER_NAMES)})")
    return KNOWN_PRE_TOKENIZERS[digest]


# -------------------------------------------------------------------------------------- tensors
def checkpoint_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every safetensors shard, one tensor in memory at a time, each checked finite."""
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise UserError(f"'{directory}' has no *.safetensors weights to export")
    for shard in shards:
        with safe_open(shard, framework="pt") as reader:
            for name in reader.keys():
                tensor = reader.get_tensor(name)
                require_finite(name, tensor, str(directory))
                yield name, tensor


def rope_pairs_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q or k from Hugging Face's half-split RoPE (i, i + d/2) to adjacent pairs (2i, 2i + 1)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def split_kv_b(weight: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [H * (nope + v), rank] -> k_b [H, rank, nope] and v_b [H, v, rank] (llama.cpp's absorbed MLA)."""
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    per_head = weight.view(config["num_attention_heads"], nope + v, weight.shape[-1])
    k_b, v_b = per_head.split([nope, v], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def gguf_tensors(directory: Path, config: dict, architecture: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under llama.cpp's names, in its layout."""
    names = gguf.get_tensor_name_map(ARCHITECTURES[architecture], config["num_hidden_layers"])
    for name, tensor in checkpoint_tensors(directory):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name.endswith("kv_b_proj.weight"):
            k_b, v_b = split_kv_b(tensor, config)
            yield gguf_name(names, name.replace("kv_b_proj", "k_b_proj")), k_b
            yield gguf_name(names, name.replace("kv_b_proj", "v_b_proj")), v_b
            continue
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config.get("num_key_value_heads") or config["num_attention_heads"]
            tensor = rope_pairs_interleaved(tensor, heads)
        yield gguf_name(names, name), tensor


def gguf_name(names: gguf.TensorNameMap, name: str) -> str:
    mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise UserError(f"tensor '{name}' has no place in llama.cpp's graph; export cannot write this checkpoint")
    return mapped


def stored(tensor: torch.Tensor, dtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """The array written and its GGML type: 1-D tensors in float32, the rest in ``dtype``."""
    data = tensor.float().numpy()
    kind = DTYPES["f32"] if tensor.ndim == 1 else DTYPES[dtype]
    if kind == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16), kind
    if kind == gguf.GGMLQuantizationType.BF16:
        return gguf.quants.quantize(data, kind), kind
    return data, kind


# -------------------------------------------------------------------------------------- metadata
def add_hyperparameters(writer: gguf.GGUFWriter, config: dict, architecture: str) -> None:
    rope = config.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    heads = config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(theta)
    writer.add_vocab_size(config["vocab_size"])
    if architecture == "llama":
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
        writer.add_rope_dimension_count(head_dim)
        return
    # DeepSeek2: MLA seen as MQA over the latent (one KV head of width kv_lora_rank + RoPE dims).
    rank, rope_dim = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(rope_dim)
    writer.add_leading_dense_block_count(config["num_hidden_layers"])
    writer.add_q_lora_rank(config.get("q_lora_rank") or 0)
    writer.add_kv_lora_rank(rank)
    writer.add_key_length(rank + rope_dim)
    writer.add_value_length(rank)
    writer.add_key_length_mla(config["qk_nope_head_dim"] + rope_dim)
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
    writer.add_expert_shared_count(0)
    writer.add_expert_count(0)  # every layer is dense


def add_tokenizer(writer: gguf.GGUFWriter, directory: Path, vocab_size: int, pre: str) -> None:
    """A GPT-2 style BPE vocabulary from tokenizer.json, with merges and special tokens."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"'{directory}' has no tokenizer.json; export writes byte-level BPE tokenizers only")
    spec = json.loads(path.read_text(encoding="utf-8"))
    if spec.get("model", {}).get("type") != "BPE":
        raise UserError(f"the tokenizer is {spec.get('model', {}).get('type')}, not BPE; export writes BPE tokenizers only")
    tokens: dict[int, tuple[str, gguf.TokenType]] = {i: (t, gguf.TokenType.NORMAL) for t, i in spec["model"]["vocab"].items()}
    for added in spec.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        tokens[added["id"]] = (added["content"], kind)
    size = max(vocab_size, max(tokens) + 1)
    listed = [tokens.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED)) for i in range(size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t for t, _ in listed])
    writer.add_token_types([int(k) for _, k in listed])
    gguf.SpecialVocab(directory, load_merges=True, n_vocab=size).add_to_gguf(writer, quiet=True)


# ----------------------------------------------------------------------------------------- export
def local_directory(source: ModelSource) -> Path:
    if source.kind == "gguf":
        raise UserError(f"'{source.ref}' is already a GGUF file")
    if source.kind == "hub":
        raise UserError(f"'{source.ref}' is a hub id; export reads a local checkpoint directory")
    return Path(source.path)


def export_gguf(ref: str, output: Path, dtype: str = "auto", tokenizer_pre: str | None = None,
                overwrite: bool = False) -> GGUFExport:
    """Write ``ref`` (an MLA conversion or a Llama-family checkpoint) to ``output`` as GGUF, atomically."""
    source = resolve_source(ref)
    directory = local_directory(source)
    config = json.loads((directory / "config.json").read_text())
    architecture = export_architecture(config)
    if dtype == "auto":
        dtype = SOURCE_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), "f32")
    if dtype not in DTYPES:
        raise UserError(f"unknown GGUF dtype '{dtype}'; choose auto, {', '.join(DTYPES)}")
    output = Path(output)
    check_output_file(output, overwrite, [directory], ours=exported_by_attnsurg(output))
    check_checkpoint_tensors(source)  # every tensor the config needs is there: no block is left out
    pre = checked_pre_tokenizer(tokenizer_pre) if tokenizer_pre else pre_tokenizer_of(directory)

    with refused_writes(output):
        handle, staging = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent)
        os.close(handle)
        try:
            count = write_gguf(staging, directory, config, architecture, dtype, pre)
            os.chmod(staging, 0o666 & ~current_umask())
            check_output_file(output, overwrite, [directory], ours=exported_by_attnsurg(output))
            os.replace(staging, output)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
    return GGUFExport(output, architecture, count, output.stat().st_size)


def write_gguf(path: str, directory: Path, config: dict, architecture: str, dtype: str, pre: str) -> int:
    """The GGUF file at ``path``; returns how many tensors it holds."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name(config.get("_name_or_path") or directory.name)
    writer.add_string(GGUF_MARK, __version__)
    writer.add_file_type(FILE_TYPES[dtype])
    add_hyperparameters(writer, config, architecture)
    add_tokenizer(writer, directory, config["vocab_size"], pre)
    count = 0
    for name, tensor in gguf_tensors(directory, config, architecture):
        data, kind = stored(tensor, dtype)
        writer.add_tensor(name, data, raw_dtype=kind)
        count += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count


def exported_by_attnsurg(path: Path) -> bool:
    """Whether ``path`` is a GGUF file this tool wrote (it carries ``GGUF_MARK``)."""
    if not path.is_file():
        return False
    try:
        return GGUF_MARK in gguf.GGUFReader(path).fields
    except Exception:  # any file that does not parse as GGUF is not ours  # noqa: BLE001
        return False
