"""``convert --to mla``'s settings and defaults: light to import (the command line builds its options from them
without loading the method)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from attnsurg.recipe import ConvertSettings
from attnsurg.requests import COMMAND_CALIBRATION, Calibration

# MLA's calibration: 12 windows of 512 over the six domains in turn, the first half refined on (one window of
# every domain), the next two held out. Against 4096 (four domains refined on, one multilingual window held
# out) with 40 steps, at 0.5 the worst of six domains goes x1.662 -> x1.481 on SmolLM2-135M and x4.382 ->
# x2.061 on Qwen2.5-Coder-0.5B (docs/mla-models.md).
MLA_CALIBRATION_TOKENS = 6144
MLA_CALIBRATION = COMMAND_CALIBRATION.model_copy(update={"tokens": MLA_CALIBRATION_TOKENS})


def refined_share(calibration_tokens: int) -> int:
    """The calibration tokens refinement trains on when not told: the first half."""
    return calibration_tokens // 2


class MLASettings(ConvertSettings):
    """``convert --to mla``: the KV budget as a fraction, or as a latent rank plus RoPE dims."""

    to: Literal["mla"] = "mla"
    kv_budget: float | None = Field(None, gt=0, le=1)
    kv_rank: int | None = Field(None, gt=0)
    rope_dim: int | None = Field(None, ge=0)
    rope_layout: Literal["standard", "flexible"] = "standard"
    rope_fold: int | None = Field(None, ge=1)  # None: FreqFold wherever the RoPE pairs are too few for the frequencies
    split: Literal["rule", "measured"] = "rule"  # measured: the RoPE width scored on held-out calibration windows
    format: Literal["native", "exact"] = "native"
    engine: Literal["transformers", "llama.cpp", "vllm", "sglang"] | None = None  # refuse what it would not run
    nope_width: Literal["latent", "head"] = "head"  # latent: no-RoPE heads as wide as the latent (more parameters)
    weighted: bool = True
    token_weights: Literal["uniform", "received"] = "uniform"  # received: the cache fitted on the attention each token receives
    refine_steps: int = Field(60, ge=0)
    refine_tokens: int | None = Field(None, gt=0)  # None: the first half of the calibration tokens
    refine_lr: float = Field(1e-3, gt=0)
    refine_schedule: Literal["constant", "cosine"] = "constant"
    short_prompts: float = Field(0.1, ge=0, lt=1)  # share of each calibration window cut into short prompts

    def check_with(self, calibration: Calibration) -> None:
        """Refinement reads the first refine_tokens of the calibration windows: a count asked for beyond them is an
        error; unset, it reads the first half of them (``refined_share``)."""
        if self.refine_steps and self.refine_tokens is not None and self.refine_tokens > calibration.tokens:
            raise ValueError(
                f"refinement reads {self.refine_tokens} tokens (refine_tokens, --refine-tokens) but calibration has "
                f"{calibration.tokens} (calibration.tokens, --calib-tokens); raise the one or lower the other"
            )
