"""Assembling factorized checkpoints: the source family's architecture under attnsurg's model type,
with some modules replaced as ``config.attnsurg`` records (see :mod:`attnsurg.modeling.modeling_attnsurg`)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel

from attnsurg.modeling import auto_map
from attnsurg.modeling.modeling_attnsurg import CLASSES


def attnsurg_config(source: PreTrainedModel | PretrainedConfig, surgery: dict):
    """The source family's config under attnsurg's model type, recording ``surgery`` (from a model or its config)."""
    fields = (source if isinstance(source, PretrainedConfig) else source.config).to_dict()
    base = fields["model_type"]  # the loaded form's family (Phi-3 loads as Mistral)
    config_class, model_class = CLASSES[base]
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "attnsurg"):
        fields.pop(key, None)
    config = config_class(**fields, attnsurg=surgery)
    config.auto_map = auto_map(base)
    config.architectures = [model_class.__name__]
    return config


def assemble_factorized(
    source: PreTrainedModel,
    surgery: dict,
    replaced: dict[str, dict[str, torch.Tensor]],
    added: dict[str, torch.Tensor] | None = None,
) -> PreTrainedModel:
    """The attnsurg model with the source's weights, where each module path in ``replaced`` loses its old
    tensors and takes the given ones (names relative to the module), plus ``added`` tensors (full names)."""
    config = attnsurg_config(source, surgery)
    model = CLASSES[source.config.model_type][1](config).to(source.dtype)
    state = source.state_dict()
    for path, tensors in replaced.items():
        for key in [k for k in state if k.startswith(path + ".")]:
            del state[key]
        state.update({f"{path}.{name}": tensor for name, tensor in tensors.items()})
    state.update(added or {})
    return load_complete_state(model, state, source.dtype)


def load_complete_state(model: PreTrainedModel, state: dict[str, torch.Tensor], dtype: torch.dtype) -> PreTrainedModel:
    """Load ``state`` (cast to ``dtype``) into a freshly built model; every tensor must find its place and
    every parameter must be given, except a tied ``lm_head``."""
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    tied = model.config.tie_word_embeddings
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"assembly mismatch: missing {missing}, unexpected {unexpected}")
    if tied:
        model.tie_weights()
    return model.eval()
