"""Typed requests: every command builds one of these, and a YAML recipe can build the same objects.

Method code receives these objects (or plain values taken from them) and never reads CLI state.
Unknown keys are rejected so a typo in a recipe is an error, not a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["auto", "float32", "bfloat16", "float16"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(Strict):
    """A model to load: a local directory, a .gguf file, a hub id or a built-in name."""

    ref: str
    trust_remote_code: bool = False
    allow_pickle: bool = False


class TextData(Strict):
    """Text to read: a built-in dataset or a UTF-8 file, and which part of it."""

    dataset: str | None = None
    text: Path | None = None
    part: Literal["eval", "calib"] = "eval"

    @model_validator(mode="after")
    def _one_source(self) -> TextData:
        if self.dataset and self.text:
            raise ValueError("give either dataset or text, not both")
        return self


class PerplexityEval(Strict):
    """``attnsurg eval perplexity``: the same windows for every model, scored in one run."""

    models: list[ModelRef] = Field(min_length=1)
    data: TextData = TextData(dataset="wiki-sample")
    max_length: int = Field(1024, gt=1)
    stride: int | None = Field(None, gt=0)
    max_tokens: int | None = Field(None, gt=1)
    batch_size: int = Field(1, gt=0)
    dtype: DType = "auto"
    device: str = "auto"
    seed: int = 0

    @property
    def effective_stride(self) -> int:
        return self.stride or self.max_length

    @model_validator(mode="after")
    def _stride_within_window(self) -> PerplexityEval:
        if self.stride is not None and self.stride > self.max_length:
            raise ValueError(f"stride ({self.stride}) must not exceed max_length ({self.max_length})")
        if self.max_tokens is not None and self.max_tokens < self.max_length:
            raise ValueError(f"max_tokens ({self.max_tokens}) is smaller than one window ({self.max_length})")
        return self


class InfoRequest(Strict):
    """``attnsurg info``: the attention anatomy of one model, read from its config."""

    model: ModelRef


class Calibration(Strict):
    """Calibration text (always its calibration part) and how much of it to use."""

    data: TextData = TextData(dataset="wiki-sample", part="calib")
    tokens: int = Field(4096, gt=0)
    seq_len: int = Field(512, gt=1)


class ConvertMLA(Strict):
    """``attnsurg convert MODEL --to mla``: GQA/MHA to a DeepseekV3 (latent attention) checkpoint."""

    model: ModelRef
    output: Path
    kv_budget: float | None = None
    kv_rank: int | None = None
    rope_dim: int | None = None
    rope_layout: Literal["standard", "flexible"] = "standard"
    weighted: bool = True
    refine_steps: int = Field(20, ge=0)
    refine_tokens: int = Field(2048, gt=0)
    refine_lr: float = Field(1e-3, gt=0)
    calibration: Calibration = Calibration()
    eval_tokens: int = Field(2048, ge=0)
    overwrite: bool = False
    seed: int = 0


class CompressLowRank(Strict):
    """``attnsurg compress MODEL --method svd|asvd|svdllm``: low-rank attention projections.

    The budget is either ``ratio`` (the fraction of the targeted projections' parameters kept; with
    ``kv_latent``, the fraction of the KV cache kept) or one ``rank`` for every targeted projection.
    """

    model: ModelRef
    output: Path
    method: Literal["svd", "asvd", "svdllm"] = "svdllm"
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    ratio: float | None = None
    rank: int | None = None
    kv_latent: bool = False
    allocate: bool = False
    weighted: bool | None = None
    calibration: Calibration = Calibration()
    eval_tokens: int = Field(2048, ge=0)
    overwrite: bool = False
    seed: int = 0


class CompressHeadTensor(Strict):
    """``attnsurg compress MODEL --method tucker|cp``: per-head weights as a decomposed tensor.

    The budget is either ``ratio`` (the fraction of the targeted projections' parameters kept) or
    ``ranks``: Tucker's (heads, head_dim, hidden) mode ranks, or CP's single rank.
    """

    model: ModelRef
    output: Path
    method: Literal["tucker", "cp"] = "tucker"
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    ratio: float | None = None
    ranks: tuple[int, ...] | None = None
    weighted: bool = True
    calibration: Calibration = Calibration()
    eval_tokens: int = Field(2048, ge=0)
    overwrite: bool = False
    seed: int = 0


class CompressLoki(Strict):
    """``attnsurg compress MODEL --method loki``: keys scored by R principal coordinates, top-k attention.

    ``top_k`` is a count of keys, or (a float in (0, 1]) a fraction of each query's context.
    """

    model: ModelRef
    output: Path
    method: Literal["loki"] = "loki"
    rank: int | None = None
    top_k: int | float | None = None
    basis: Literal["post-rope", "pre-rope"] = "post-rope"
    calibration: Calibration = Calibration()
    eval_tokens: int = Field(2048, ge=0)
    overwrite: bool = False
    seed: int = 0
