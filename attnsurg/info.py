"""``attnsurg info``: a model's attention anatomy, read from its config without loading weights."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from attnsurg.arch.anatomy import AttentionAnatomy, inspect_config
from attnsurg.io.load import ModelSource, load_config, resolve_source
from attnsurg.methods import method_support
from attnsurg.requests import InfoRequest, ModelRef


def inspect_model(ref: ModelRef) -> tuple[ModelSource, PretrainedConfig, AttentionAnatomy]:
    """Resolve a model reference and read its config and anatomy, with every safety check; no weights."""
    source = resolve_source(ref.ref, ref.allow_pickle, ref.trust_remote_code)
    config = load_config(source, ref.trust_remote_code)
    return source, config, inspect_config(config, ref.trust_remote_code)


def describe(request: InfoRequest) -> dict[str, Any]:
    ref = request.model
    source, _, anatomy = inspect_model(ref)
    return {"model": ref.ref, "source": source.kind, "anatomy": anatomy.to_dict(), "methods": method_support(anatomy)}
