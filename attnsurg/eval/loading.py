"""One model at a time, loaded for measuring: resolve, check, load weights and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel

from attnsurg import ui
from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.info import inspect_model
from attnsurg.io.load import ModelSource, load_model, load_tokenizer, resolve_device, resolve_dtype
from attnsurg.recipe import ModelRef


@dataclass
class Loaded:
    ref: ModelRef
    source: ModelSource
    config: PretrainedConfig
    anatomy: AttentionAnatomy
    model: PreTrainedModel
    tokenizer: object
    device: torch.device
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)


def check_models_exist(models: list[ModelRef]) -> None:
    """Every reference resolves and has a readable config, before any model is loaded (a typo in the
    last path fails in a second, not after the first model has been scored)."""
    for ref in models:
        inspect_model(ref)


def load_for_eval(ref: ModelRef, device_name: str, dtype_name: str) -> Loaded:
    source, config, anatomy = inspect_model(ref)
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, device, config)
    tokenizer = load_tokenizer(source, ref.trust_remote_code)
    with ui.status(f"Loading {ref.ref}..."):
        model = load_model(source, dtype, device, ref.trust_remote_code, ref.allow_pickle)
    return Loaded(ref, source, config, anatomy, model, tokenizer, device, dtype)
