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
    model: PreTrainedModel | None
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


def prepare_for_eval(ref: ModelRef, device_name: str, dtype_name: str) -> Loaded:
    """Config, anatomy, tokenizer, device and dtype of a model; its weights come with ``load_weights``."""
    source, config, anatomy = inspect_model(ref)
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, device, config)
    return Loaded(ref, source, config, anatomy, None, load_tokenizer(source, ref.trust_remote_code), device, dtype)


def load_weights(loaded: Loaded) -> None:
    with ui.status(f"Loading {loaded.ref.ref}..."):
        loaded.model = load_model(loaded.source, loaded.dtype, loaded.device, loaded.ref.trust_remote_code,
                                  loaded.ref.allow_pickle)

