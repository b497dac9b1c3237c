"""Model-family knowledge: adapters and the attention anatomy of a checkpoint."""

from attnsurg.arch.anatomy import AttentionAnatomy, inspect_config
from attnsurg.arch.families import SURGERY_FAMILIES, Family, family_for_surgery, supported_names

__all__ = ["AttentionAnatomy", "Family", "SURGERY_FAMILIES", "family_for_surgery", "inspect_config", "supported_names"]
