"""Dequantize a GGUF checkpoint with transformers into a model that can be saved as safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel


def load_gguf(gguf_file: Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, dict]:
    """Dequantize a GGUF checkpoint with transformers; returns a model that can be saved and the loading report
    of ``from_pretrained`` (its ``missing_keys``: what the GGUF's blocks did not fill)."""
    model, info = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=dtype,
                                                       output_loading_info=True)
    strip_quantizer(model)
    return model, info


def load_gguf_tokenizer(gguf_file: Path):
    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def strip_quantizer(model: PreTrainedModel) -> None:
    """Forget the GGUF quantizer: the weights are already dequantized, and save_pretrained refuses otherwise."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
