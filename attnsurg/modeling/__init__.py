"""Model classes for checkpoints attnsurg writes in its own format (low-rank attention).

:mod:`attnsurg.modeling.modeling_attnsurg` is copied verbatim into each such checkpoint (for
``trust_remote_code=True`` users); :func:`register` makes transformers' Auto classes build the same
classes here without any remote code.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

from attnsurg.modeling.modeling_attnsurg import CLASSES

MODELING_FILE = Path(__file__).with_name("modeling_attnsurg.py")
MODEL_TYPES = {config.model_type: base for base, (config, _) in CLASSES.items()}

_registered = False


def register() -> None:
    """Register the attnsurg model types with AutoConfig / AutoModelForCausalLM (idempotent)."""
    global _registered
    if _registered:
        return
    for config_class, model_class in CLASSES.values():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
    _registered = True


def auto_map(base_model_type: str) -> dict[str, str]:
    """The config ``auto_map`` that points transformers at the copied modeling file."""
    config_class, model_class = CLASSES[base_model_type]
    module = MODELING_FILE.stem
    return {"AutoConfig": f"{module}.{config_class.__name__}", "AutoModelForCausalLM": f"{module}.{model_class.__name__}"}
