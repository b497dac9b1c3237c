"""``convert --to linear``'s settings and defaults: light to import (the command line builds its options from
them without loading the method)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from attnsurg.recipe import ConvertSettings
from attnsurg.requests import COMMAND_CALIBRATION

NAME = "linear"
LINEAR_CALIBRATION_TOKENS = 24576  # 48 windows of 512: at 12 the feature maps overfit (held-out error 2-4x the fit's)
SINKS = 4  # the first keys of a sequence kept exact, as StreamingLLM keeps them (Xiao et al. 2024)
TRANSFER_STEPS = {"hedgehog": 300, "performer": 0}  # Performer's random features need no data
LINEAR_CALIBRATION = COMMAND_CALIBRATION.model_copy(update={"tokens": LINEAR_CALIBRATION_TOKENS})


class LinearSettings(ConvertSettings):
    """``convert --to linear``: softmax attention over the last ``window`` keys and the first ``sinks`` of the
    sequence, a linear attention over the other older ones through feature maps of ``feature_dim`` per half
    (default head_dim): learned Hedgehog maps, or Performer's random features, data-free unless
    ``transfer_steps`` asks for training."""

    to: Literal["linear"] = NAME
    window: int = Field(256, ge=1)
    sinks: int = Field(SINKS, ge=0)
    feature_map: Literal["hedgehog", "performer"] = "hedgehog"
    feature_dim: int | None = Field(None, ge=1)
    transfer_steps: int | None = Field(None, ge=0)
    transfer_lr: float = Field(1e-2, gt=0)
    decay: bool | None = None  # None: with Hedgehog's maps (see ``decays``)
    features_before_rope: bool | None = None  # None: with Hedgehog's maps (see ``reads_before_rope``)
    full_layers: tuple[int, ...] = ()  # layers that keep softmax attention over the whole context
    retrieval_layers: int = Field(0, ge=0)  # as many, chosen by measured long-range copying (``linear.retrieval``)

    @field_validator("full_layers", mode="before")
    @classmethod
    def comma_separated(cls, value):
        """The command line gives the layers as one string, "3,7,11"."""
        if isinstance(value, str):
            parts = [part.strip() for part in value.split(",") if part.strip()]
            if not all(part.isdigit() for part in parts):
                raise ValueError(f"layer indices separated by commas, e.g. 3,7; got {value!r}")
            return tuple(int(part) for part in parts)
        return value

    @model_validator(mode="after")
    def one_choice_of_full_layers(self):
        if self.full_layers and self.retrieval_layers:
            raise ValueError("give the layers that keep softmax attention either by index (full_layers, --full-layers) "
                             "or by count (retrieval_layers, --retrieval-layers), not both")
        return self

    @property
    def steps(self) -> int:
        """Attention-transfer steps per layer: as set, or the feature map's default."""
        return TRANSFER_STEPS[self.feature_map] if self.transfer_steps is None else self.transfer_steps

    @property
    def decays(self) -> bool:
        """Whether the linear part fades with distance: as set, or where the maps are learned (nothing would fit
        a decay to Performer's data-free features)."""
        return self.feature_map == "hedgehog" if self.decay is None else self.decay

    @property
    def reads_before_rope(self) -> bool:
        """Whether the maps read queries and keys before RoPE: as set, or where the maps are learned (Performer's
        features estimate exp(q . k) of the rotated ones, the scores themselves)."""
        return self.feature_map == "hedgehog" if self.features_before_rope is None else self.features_before_rope
