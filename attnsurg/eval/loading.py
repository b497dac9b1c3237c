"""One model at a time, loaded for measuring: resolve, check, load weights and tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel

from attnsurg import ui
from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.errors import UserError
from attnsurg.info import inspect_model
from attnsurg.io.load import ModelSource, load_model, load_tokenizer, resolve_device, resolve_dtype
from attnsurg.modeling.absorbed import use_runtime
from attnsurg.requests import ModelRef


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


def check_models(models: list[ModelRef], check: Callable[[ModelRef, PretrainedConfig], None] | None = None) -> None:
    """Every reference resolves, appears once and has a readable config, and passes ``check`` (a length
    against its context, say), before any weights load: a typo or a too-long context for the last model
    fails in a second, not after the first model has been scored."""
    seen = set()
    for ref in models:
        if ref.ref in seen:
            raise UserError(f"'{ref.ref}' is named twice; name each model once")
        seen.add(ref.ref)
        _, config, _ = inspect_model(ref)
        if check is not None:
            check(ref, config)


def prepare_for_eval(ref: ModelRef, device_name: str, dtype_name: str) -> Loaded:
    """Config, anatomy, tokenizer, device and dtype of a model; its weights come with ``load_weights``."""
    source, config, anatomy = inspect_model(ref)
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, device, config)
    return Loaded(ref, source, config, anatomy, None, load_tokenizer(source, ref.trust_remote_code), device, dtype)


def load_weights(loaded: Loaded) -> None:
    """The model's weights, an MLA checkpoint in the attnsurg runtime (the stock path's logits:
    ``modeling/absorbed.py``)."""
    with ui.status(f"Loading {loaded.ref.ref}..."):
        loaded.model = load_model(loaded.source, loaded.dtype, loaded.device, loaded.ref.trust_remote_code,
                                  loaded.ref.allow_pickle)
    use_runtime(loaded.model, "attnsurg")

