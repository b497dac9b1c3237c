"""The interface every surgery method implements, and the registry the one surgery pipeline dispatches through.

A method (:class:`SurgeryMethod`) owns its settings (a recipe step and its command's options), its plan, its
operation on a loaded model (``operate_model``) and on one decoder layer at a time (``operate_streamed``),
its report and what its model card says. ``pipelines/surgery.py`` calls these and nothing else of the method.
The ``compress`` methods share :class:`CompressMethod`, which runs the whole-model and the streamed operation
from each layer's input statistics through the method's one per-layer operation (``operate_layer``), so such
a method writes its plan, that operation and its card text; ``convert --to mla`` (``methods/mla/method.py``)
implements the interface itself. Adding a method is one module holding one subclass, registered with
:func:`register_method`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import PretrainedConfig, PreTrainedModel

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import Family
from attnsurg.calibrate import InputStatistics
from attnsurg.methods import catalog
from attnsurg.methods.consumers import LayerContext, layer_contexts
from attnsurg.recipe import CompressSettings
from attnsurg.requests import COMMAND_CALIBRATION, Calibration

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
    """What a method's model card says of it; the pipeline adds the model, the command and the scores."""

    title: str  # follows the model's name: "with low-rank attention (svdllm)"
    summary: str
    tags: list[str]
    details: list[str]
    figures: list[dict]
    sections: dict[str, str] = field(default_factory=dict)


@dataclass
class SurgeryInputs:
    """What an operation reads besides its settings and plan: where the source's modules live, the
    calibration windows (token ids) and the request they were cut by, the device the passes run on and the seed."""

    family: Family
    windows: torch.Tensor
    calibration: Calibration
    device: torch.device | None = None
    seed: int = 0


@dataclass
class SurgeryReport:
    """What a surgery run reports; a method with figures of its own extends it (``SurgeryMethod.report_type``)."""

    plan: Any
    anatomy: AttentionAnatomy
    written: str | None = None
    seconds: float = 0.0
    operation_seconds: float = 0.0  # the method's own work (calibration pass included): not loading, scoring or writing
    peak_memory_gb: float = 0.0
    ppl_before: float | None = None
    ppl_after: float | None = None
    domains: dict[str, tuple[float, float]] = field(default_factory=dict)  # ppl before/after off the calibration text
    long_context: Any = None  # source and result's eval.long_context.LongContextScore, where asked for
    heal: Any = None  # a heal.HealReport when the recipe heals
    errors: list = field(default_factory=list)  # each unit's relative error, where the method measures one
    streamed: bool = False  # the source read one decoder layer at a time


@dataclass
class StreamTarget:
    """Where a streamed operation writes: the staged output directory, the output dtype, the shard size, and
    the per-layer checkpoints a stopped run resumes from (``io.resume.LayerCheckpoints``)."""

    directory: Path
    dtype: torch.dtype
    max_shard_size: int | str
    checkpoints: Any = None


class SurgeryMethod(ABC):
    """One surgery method. ``names`` are the values its recipe step answers to (``--method``, or ``--to``);
    ``settings`` the class of its step and options; ``plan_type`` the class of the plans it makes, by which a
    plan finds its method again (``method_of``); ``step`` the recipe step and command it runs under."""

    names: ClassVar[tuple[str, ...]]
    settings: ClassVar[type]
    plan_type: ClassVar[type]
    step: ClassVar[str]  # "convert" or "compress"
    report_type: ClassVar[type[SurgeryReport]] = SurgeryReport
    timed_step: ClassVar[str | None] = None  # what the report's seconds of the operation are called
    seconds_key: ClassVar[str] = "operation_seconds"  # the same in the ``--json`` record
    calibration: ClassVar[Calibration] = COMMAND_CALIBRATION  # what its command calibrates on when not told

    def handles(self, settings) -> bool:
        """Whether this method runs these settings."""
        return isinstance(settings, self.settings) and self.name_of(settings) in self.names

    def name_of(self, settings) -> str:
        return settings.method

    @abstractmethod
    def plan(self, anatomy: AttentionAnatomy, settings) -> Any:
        """The plan for ``anatomy``, or a ``UserError`` saying why the settings do not fit the model."""

    def check_calibration(self, settings, calibration: Calibration) -> None:
        """Refuse a calibration request these settings cannot use (before any weights load)."""

    def stream_refusal(self, settings, plan) -> str | None:
        """Why this run cannot read the source one layer at a time, or None."""
        return None

    @abstractmethod
    def operate_model(self, source: PreTrainedModel, inputs: SurgeryInputs, settings, report: SurgeryReport,
                      progress: Progress = None) -> PreTrainedModel:
        """Every layer of the loaded source (float32, on the CPU); the result, the report filled with the plan
        as made (ranks chosen on data) and the method's figures."""

    @abstractmethod
    def operate_streamed(self, reader, source_config: PretrainedConfig, inputs: SurgeryInputs, settings,
                         report: SurgeryReport, target: StreamTarget, progress: Progress = None) -> PretrainedConfig:
        """The same surgery with one source decoder layer in memory at a time (``reader``: an
        ``io.lazy.CheckpointReader``), written into ``target``; the written model's config."""

    @abstractmethod
    def card_text(self, settings, report: SurgeryReport, calibration: Calibration, healing: str) -> CardText:
        """What the checkpoint's card says of the surgery (``healing``: the card's word on it)."""

    @abstractmethod
    def report_record(self, report: SurgeryReport) -> dict:
        """The method's figures in the command's ``--json`` record (the run's own follow them)."""

    @abstractmethod
    def report_text(self, model: str, report: SurgeryReport, dry_run: bool) -> list:
        """What the command prints of the plan (strings or rich renderables), before what every run prints."""

    def result_text(self, report: SurgeryReport) -> list:
        """What the command prints after the line saying where the result was written."""
        return []

    def progress_label(self, settings) -> str:
        return f"Operating ({self.name_of(settings)})"

    def step_label(self, settings) -> str:
        """The step in a list of recipes: what it does and at what budget."""
        return f"{self.step} to {self.name_of(settings)}"

    def extra_files(self) -> dict[str, str]:
        """Files written beside the checkpoint (the modeling code a replaced attention loads with)."""
        return {}


class CompressMethod(SurgeryMethod):
    """A ``compress`` method: it operates on each layer from its attention-input and o_proj-input statistics
    (``operate_layer``: a streamed run calls it layer by layer, a loaded one through ``operate``), and its
    checkpoint loads with attnsurg's modeling file."""

    settings: ClassVar[type[CompressSettings]]
    step: ClassVar[str] = "compress"
    seconds_key: ClassVar[str] = "factorize_seconds"

    def progress_label(self, settings) -> str:
        return f"Factorizing ({settings.method})"

    def extra_files(self) -> dict[str, str]:
        from attnsurg.modeling import MODELING_FILE

        return {MODELING_FILE.name: MODELING_FILE.read_text(encoding="utf-8")}

    def stream_refusal(self, settings, plan) -> str | None:
        return self.plan_stream_refusal(plan)

    def plan_stream_refusal(self, plan) -> str | None:
        """Why this plan cannot run one layer at a time, or None."""
        return None

    def needs_survey(self, plan) -> bool:
        """Whether the plan needs every layer seen before any is operated on (a streamed run then makes a first
        pass over the layers: ``survey_layer`` each, then ``surveyed``)."""
        return False

    def survey_layer(self, plan, index: int, context: LayerContext) -> Any:
        """What the first pass keeps of layer ``index``."""
        raise NotImplementedError

    def surveyed(self, plan, surveys: list) -> None:
        """The plan completed from every layer's survey, in order."""
        raise NotImplementedError

    def operate_model(self, source: PreTrainedModel, inputs: SurgeryInputs, settings, report: SurgeryReport,
                      progress: Progress = None) -> PreTrainedModel:
        from attnsurg.methods.compress_layers import compress_loaded

        result = compress_loaded(source, inputs.family, inputs.windows, report.plan, progress, inputs.device, inputs.seed)
        report.plan, report.errors = result.plan, result.errors
        return result.model

    def operate_streamed(self, reader, source_config: PretrainedConfig, inputs: SurgeryInputs, settings,
                         report: SurgeryReport, target: StreamTarget, progress: Progress = None) -> PretrainedConfig:
        from attnsurg.methods.compress_layers import compress_streamed

        written, report.errors = compress_streamed(
            reader, source_config, inputs.family, inputs.windows, report.plan, target.directory, target.dtype,
            target.max_shard_size, progress, inputs.device, target.checkpoints, inputs.seed)
        return written

    def card_text(self, settings, report: SurgeryReport, calibration: Calibration, healing: str) -> CardText:
        text = self.plan_card_text(settings, report.plan, report.anatomy)
        text.details = text.details + [
            f"calibration: {calibration.tokens} tokens of the calibration part of {calibration.data.described()}, "
            f"windows of {calibration.seq_len}; {healing}"]
        return text

    def report_record(self, report: SurgeryReport) -> dict:
        return self.plan_record(report.plan, report.anatomy)

    def report_text(self, model: str, report: SurgeryReport, dry_run: bool) -> list:
        return self.plan_text(model, report.plan, report.anatomy, dry_run)

    @torch.no_grad()
    def operate(self, model: PreTrainedModel, family: Family, statistics: list[LayerStatistics], plan,
                seq_len: int, seed: int = 0, progress: Progress = None) -> Operated:
        """Every layer of a loaded model, from each layer's calibration statistics: ``operate_layer`` on each
        (after a first pass of ``survey_layer`` where the plan needs one), assembled in memory as a streamed
        run writes it; ``progress()`` once a layer."""
        from attnsurg.methods.factorized import assemble_factorized

        contexts = layer_contexts(model, family, statistics, seq_len)
        if self.needs_survey(plan):
            self.surveyed(plan, [self.survey_layer(plan, index, context) for index, context in enumerate(contexts)])
        layers = []
        for index, context in enumerate(contexts):
            layers.append(self.operate_layer(plan, family, index, context, seed))
            if progress:
                progress()
        records = [record for layer in layers for record in layer.records]
        self.warn_capped(plan, [fit for layer in layers for fit in layer.unconverged], len(records))
        errors = self.apply_records(plan, records)
        replaced = {path: state for layer in layers for path, state in layer.replaced.items()}
        added = {name: tensor for layer in layers for name, tensor in layer.added.items()}
        return Operated(assemble_factorized(model, self.surgery(plan, family), replaced, added), plan, errors)

    @abstractmethod
    def operate_layer(self, plan, family: Family, index: int, context: LayerContext, seed: int) -> LayerTensors:
        """Layer ``index`` alone, from its statistics: what every run of the method does, one layer at a time."""

    @abstractmethod
    def plan_card_text(self, settings, plan, anatomy: AttentionAnatomy) -> CardText:
        """The card's title, summary, details and figures for this plan (after the operation)."""

    @abstractmethod
    def plan_record(self, plan, anatomy: AttentionAnatomy) -> dict:
        """The plan's figures in the command's ``--json`` record (the run's own follow them)."""

    @abstractmethod
    def plan_text(self, model: str, plan, anatomy: AttentionAnatomy, dry_run: bool) -> list:
        """What the command prints of the plan (strings or rich renderables), before what every run prints."""

    def surgery(self, plan, family: Family) -> dict:
        """The ``config.attnsurg`` record the operated checkpoint is rebuilt from."""
        return plan.surgery(family)

    def planned_surgery(self, plan, family: Family) -> dict:
        """The record a streamed run plans the output's tensors by, before any layer is done."""
        return self.surgery(plan, family)

    def shapes_known_late(self, plan) -> bool:
        """Whether the factors' shapes are chosen on data, so a streamed run learns them only per layer."""
        return False

    def apply_records(self, plan, records: list) -> list[float]:
        """Every layer's ``LayerTensors.records`` into the plan; each unit's relative error."""
        return list(records)

    def warn_capped(self, plan, unconverged: list[tuple[str, float]], total: int) -> None:
        """Warn about fits stopped at their iteration cap (``total`` fits were made)."""


SURGERY_METHODS: list[SurgeryMethod] = []


def register_method(method: SurgeryMethod) -> SurgeryMethod:
    if any(method.plan_type is known.plan_type for known in SURGERY_METHODS):
        raise ValueError(f"{method.step} method {method.names} registered twice")
    SURGERY_METHODS.append(method)
    return method


def surgery_methods() -> list[SurgeryMethod]:
    """Every registered method, in listing order (each module of ``attnsurg.methods`` imported first)."""
    from attnsurg.methods import ensure_registered, listing_rank

    ensure_registered()
    return sorted(SURGERY_METHODS, key=lambda method: listing_rank(type(method).__module__))


def compress_methods() -> list[CompressMethod]:
    return [method for method in surgery_methods() if isinstance(method, CompressMethod)]


def compress_method_names() -> list[str]:
    """Every ``--method`` value, in listing order (read from the catalog: no method is imported)."""
    return catalog.names("compress")


def settings_for_method(name: str) -> type[CompressSettings] | None:
    """The settings class of the compress method named ``name``, or None when no method answers to it."""
    return next((method.settings for method in compress_methods() if name in method.names), None)


def convert_methods() -> list[SurgeryMethod]:
    return [method for method in surgery_methods() if method.step == "convert"]


def convert_target_names() -> list[str]:
    """Every ``--to`` value, in listing order (read from the catalog: no method is imported)."""
    return catalog.names("convert")


def settings_for_target(name: str) -> type | None:
    """The settings class of the convert target named ``name``, or None when no method answers to it."""
    return next((method.settings for method in convert_methods() if name in method.names), None)


def method_for(settings) -> SurgeryMethod:
    """The method that runs these settings (a recipe's surgery step)."""
    return next(method for method in surgery_methods() if method.handles(settings))


def method_of(plan) -> SurgeryMethod:
    """The method that made this plan."""
    return next(method for method in surgery_methods() if type(plan) is method.plan_type)


def operate_loaded(model: PreTrainedModel, family: Family, statistics: list[LayerStatistics], plan, seq_len: int,
                   seed: int = 0, progress: Progress = None) -> Operated:
    """A compress plan carried out on a loaded model by its method (``CompressMethod.operate``)."""
    return method_of(plan).operate(model, family, statistics, plan, seq_len, seed, progress)
