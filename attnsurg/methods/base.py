"""The interface every ``compress`` method implements, and the registry ``compress`` dispatches through.

A method owns its plan (``plan``), the whole-model operation on a loaded model (``operate``), the operation on
one decoder layer from that layer's statistics (``operate_layer``, what ``--stream`` runs) and what its model card
says (``card_text``). ``pipelines/compress.py`` and ``methods/compress_stream.py`` call these and nothing else of the
method; adding a method is one module holding one subclass, registered with :func:`register_compressor`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import Family
from attnsurg.calibrate import InputStatistics
from attnsurg.methods.consumers import LayerContext
from attnsurg.recipe import CompressSettings

LayerStatistics = tuple[InputStatistics, InputStatistics]  # a layer's attention input and o_proj input
Progress = Callable[..., None] | None


@dataclass
class Operated:
    """A whole-model operation's result: the operated model, its plan (ranks chosen on data filled in) and
    each unit's relative error (empty where the method has none)."""

    model: PreTrainedModel
    plan: Any
    errors: list[float] = field(default_factory=list)


@dataclass
class LayerTensors:
    """What one layer's surgery writes: replaced modules (module path -> its tensors), added tensors (full
    names), its records for the report and a resume, and fits stopped at their iteration cap."""

    replaced: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    added: dict[str, torch.Tensor] = field(default_factory=dict)
    records: list = field(default_factory=list)
    unconverged: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class CardText:
    """What a method's model card says of it; ``compress`` adds the model, the command and the calibration."""

    title: str  # follows the model's name: "with low-rank attention (svdllm)"
    summary: str
    tags: list[str]
    details: list[str]
    figures: list[dict]
    sections: dict[str, str] = field(default_factory=dict)


class CompressMethod(ABC):
    """One ``compress`` method. ``names`` are the ``--method`` values it answers to; ``settings`` the class of
    its recipe step and command-line options (a ``recipe.CompressSettings``); ``plan_type`` the class of the
    plans it makes, by which a plan finds its method again (``method_of``)."""

    names: ClassVar[tuple[str, ...]]
    settings: ClassVar[type[CompressSettings]]
    plan_type: ClassVar[type]
    timed_step: ClassVar[str | None] = None  # what the report's seconds of the operation are called

    def handles(self, settings) -> bool:
        """Whether this method runs these settings (``LowRankSettings``, ``HeadTensorSettings``, ...)."""
        return settings.method in self.names

    @abstractmethod
    def plan(self, anatomy: AttentionAnatomy, settings) -> Any:
        """The plan for ``anatomy``, or a ``UserError`` saying why the settings do not fit the model."""

    @abstractmethod
    def operate(self, model: PreTrainedModel, family: Family, statistics: list[LayerStatistics], plan,
                seq_len: int, seed: int, progress: Progress = None) -> Operated:
        """Every layer of a loaded model, from each layer's calibration statistics; ``progress()`` once a layer."""

    @abstractmethod
    def operate_layer(self, plan, family: Family, index: int, context: LayerContext, seed: int) -> LayerTensors:
        """Layer ``index`` alone, from its statistics, as ``operate`` does it."""

    @abstractmethod
    def card_text(self, settings, plan, anatomy: AttentionAnatomy) -> CardText:
        """The card's title, summary, details and figures for this plan (after the operation)."""

    @abstractmethod
    def report_record(self, plan, anatomy: AttentionAnatomy) -> dict:
        """The plan's figures in the command's ``--json`` record (the run's own follow them)."""

    @abstractmethod
    def report_text(self, model: str, plan, anatomy: AttentionAnatomy, dry_run: bool) -> list:
        """What the command prints of the plan (strings or rich renderables), before what every run prints."""

    def surgery(self, plan, family: Family) -> dict:
        """The ``config.attnsurg`` record the operated checkpoint is rebuilt from."""
        return plan.surgery(family)

    def planned_surgery(self, plan, family: Family) -> dict:
        """The record a streamed run plans the output's tensors by, before any layer is done."""
        return self.surgery(plan, family)

    def stream_refusal(self, plan) -> str | None:
        """Why this plan cannot run one layer at a time, or None."""
        return None

    def shapes_known_late(self, plan) -> bool:
        """Whether the factors' shapes are chosen on data, so a streamed run learns them only per layer."""
        return False

    def apply_records(self, plan, records: list) -> list[float]:
        """Every layer's ``LayerTensors.records`` into the plan; each unit's relative error."""
        return list(records)

    def warn_capped(self, plan, unconverged: list[tuple[str, float]], total: int) -> None:
        """Warn about fits stopped at their iteration cap (``total`` fits were made)."""


COMPRESSORS: list[CompressMethod] = []


def register_compressor(method: CompressMethod) -> CompressMethod:
    if any(set(method.names) & set(known.names) and method.plan_type is known.plan_type for known in COMPRESSORS):
        raise ValueError(f"compress method {method.names} registered twice")
    COMPRESSORS.append(method)
    return method


def compress_method_names() -> list[str]:
    """Every ``--method`` value, in the order the methods registered."""
    return list(dict.fromkeys(name for method in COMPRESSORS for name in method.names))


def settings_for_method(name: str) -> type[CompressSettings] | None:
    """The settings class of the method named ``name``, or None when no method answers to it."""
    return next((method.settings for method in COMPRESSORS if name in method.names), None)


def compressor_for(settings) -> CompressMethod:
    """The method that runs these settings (a request or a recipe's compress step)."""
    return next(method for method in COMPRESSORS if method.handles(settings))


def method_of(plan) -> CompressMethod:
    """The method that made this plan."""
    return next(method for method in COMPRESSORS if type(plan) is method.plan_type)
