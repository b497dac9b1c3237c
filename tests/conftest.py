"""Shared fixtures: tiny random Llama / Mistral / Qwen2 / Qwen3 checkpoints with a real byte-level BPE tokenizer.

Nothing here downloads anything; tests that need the real demo assets use the ``demo_model`` and
``wiki_text`` fixtures, which skip with the reason when the fetch is impossible.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from attnsurg.errors import UserError

CORPUS = (Path(__file__).parent / "data" / "corpus.txt").read_text(encoding="utf-8")
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def train_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer()


def tiny_config(family: str, vocab_size: int, **overrides):
    settings = {**TINY, "vocab_size": vocab_size, "eos_token_id": 0, "tie_word_embeddings": False, **overrides}
    if family == "llama":
        return LlamaConfig(**settings)
    if family == "mistral":
        return MistralConfig(**{"sliding_window": None, **settings})
    if family == "qwen2":
        return Qwen2Config(**settings)
    if family == "qwen3":  # per-head q/k RMSNorms
        return Qwen3Config(**settings)
    raise ValueError(family)


def greedy_decode_matches_recomputation(model, prompt: torch.Tensor, new_tokens: int) -> bool:
    """``generate`` with the model's cache gives the tokens that recomputing every prefix from scratch gives."""
    generated = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens, eos_token_id=None)
    with torch.no_grad():
        tokens = prompt
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, model(tokens, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return torch.equal(generated, tokens)


def build_tiny(family: str, vocab_size: int, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family, vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random weights large enough that attention is far from uniform
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # norms that are not the identity
                p.uniform_(0.5, 2.0)
    return model


def with_mean_direction(model, shift: float = 2.0):
    """Give every token embedding a shared component ``shift`` times a typical embedding's size per coordinate,
    as real language models' hidden states have (a strong mean direction): the native MLA format's
    constant channel is fitted from it, where random hidden states offer none."""
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings += shift * embeddings.norm(dim=1).mean() / embeddings.shape[1] ** 0.5
    return model


TINY_VARIANTS = {
    "llama-gqa": ("llama", {"num_key_value_heads": 2}),
    "llama-mha": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "mistral": ("mistral", {"num_key_value_heads": 2}),
    "qwen2": ("qwen2", {"num_key_value_heads": 2}),
    "qwen3": ("qwen3", {"num_key_value_heads": 2}),
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """Each tiny variant saved as a safetensors checkpoint directory with its tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    paths = {}
    for name, (family, overrides) in TINY_VARIANTS.items():
        model = build_tiny(family, len(tokenizer), **overrides)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    return paths


@pytest.fixture(params=sorted(TINY_VARIANTS))
def tiny_checkpoint(request, tiny_checkpoints) -> Path:
    return tiny_checkpoints[request.param]


@pytest.fixture
def teacher_and_tokenizer(tiny_checkpoints, tokenizer):
    """A tiny teacher for healing, with a sharpened head: random heads give near-uniform outputs, and a sharper
    teacher has something to teach."""
    teacher = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"]).eval()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(30)
    return teacher, tokenizer


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(CORPUS, encoding="utf-8")
    return path


ASSET_FIXTURES = {"demo_model", "wiki_text"}


def pytest_collection_modifyitems(items) -> None:
    """A test that asks for a real built-in asset is an ``assets`` test, whether or not it says so."""
    for item in items:
        if ASSET_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.assets)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The real demo model; skips with the reason when it cannot be fetched."""
    from attnsurg.io.assets import ensure_demo_model

    try:
        return ensure_demo_model()
    except UserError as exc:
        pytest.skip(f"demo model unavailable: {exc}")


@pytest.fixture(scope="session")
def wiki_text() -> Path:
    from attnsurg.io.assets import ensure_text

    try:
        return ensure_text("wiki-sample")
    except UserError as exc:
        pytest.skip(f"wiki-sample unavailable: {exc}")


def assert_streamed_like_loaded(loaded: Path, streamed: Path) -> None:
    """A streamed checkpoint has the loaded one's files and the same card, parameter rows and loading snippet
    included, plus its note that it was written one layer at a time; both name the causal LM class engines
    dispatch on (``architectures``)."""
    assert {p.name for p in loaded.iterdir()} == {p.name for p in streamed.iterdir()}
    architectures = [json.loads((path / "config.json").read_text()).get("architectures") for path in (loaded, streamed)]
    assert architectures[0] == architectures[1] and len(architectures[0]) == 1, architectures
    assert architectures[0][0].endswith("ForCausalLM"), architectures
    cards = {path: (path / "README.md").read_text() for path in (loaded, streamed)}
    assert "written one decoder layer at a time" in cards[streamed]
    for fragment in ("| attention parameters |", "| parameters in all |", "trust_remote_code=True"):
        assert (fragment in cards[loaded]) == (fragment in cards[streamed]), fragment
    rows = [[line for line in card.splitlines() if "parameters" in line and line.startswith("|")] for card in cards.values()]
    assert rows[0] == rows[1] and rows[0]


@pytest.fixture(scope="session")
def tiny_mla(tiny_checkpoints, corpus_file, tmp_path_factory) -> Path:
    """A 50% MLA conversion of the tiny Llama (closed form, no refinement), written by the command."""
    from typer.testing import CliRunner

    from attnsurg.cli import app

    output = tmp_path_factory.mktemp("tiny-mla") / "mla"
    result = CliRunner().invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--kv-budget", "0.5",
                                      "--calib-text", str(corpus_file), "--calib-tokens", "256", "--refine-steps", "0",
                                      "--eval-tokens", "0", "-o", str(output)])
    assert result.exit_code == 0, result.output
    return output


@pytest.fixture(scope="session")
def tiny_gguf(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny Llama exported as a GGUF file by attnsurg."""
    from attnsurg.io.gguf_export import export_gguf

    return export_gguf(str(tiny_checkpoints["llama-gqa"]), tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                       tokenizer_pre="gpt-2").path
