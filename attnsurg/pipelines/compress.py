"""``attnsurg compress``: plan -> load -> calibrate -> factorize -> evaluate -> write.

Every registered compress method runs through this one pipeline; what
differs is asked of the method itself (``methods/base.CompressMethod``: its plan, operation and card).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from attnsurg import ui
from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.calibrate import attention_layers, input_statistics
from attnsurg.info import inspect_model
from attnsurg.heal import HealReport
from attnsurg.io.card import CardInfo
from attnsurg.io.lazy import CheckpointReader
from attnsurg.io.resume import resumable_checkpoint, settings_fingerprint
from attnsurg.methods.base import compressor_for, method_of
from attnsurg.methods.compress_stream import compress_streamed
from attnsurg.methods.lowrank import PROJECTIONS
from attnsurg.modeling import MODELING_FILE
from attnsurg.pipelines.steps import (
    base_model_id,
    check_calibration,
    command_line,
    described_data,
    finish_surgery,
    healing_note,
    finish_streamed,
    operated_once,
    peak_memory_gb,
    start_streamed,
    start_surgery,
    stream_refusal,
    streams,
)
from attnsurg.recipe import Recipe, SurgeryRequest

Plan = Any  # a compress method's plan; ``method_of(plan)`` finds the method again
Request = SurgeryRequest  # a compress method's settings with the SurgeryContext (recipe.request_type)


@dataclass
class CompressReport:
    plan: Plan
    anatomy: AttentionAnatomy
    written: str | None = None
    seconds: float = 0.0
    factorize_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    ppl_before: float | None = None
    ppl_after: float | None = None
    domains: dict[str, tuple[float, float]] = field(default_factory=dict)  # ppl before/after off the calibration text
    heal: HealReport | None = None
    errors: list[float] = field(default_factory=list)
    streamed: bool = False  # the source read one decoder layer at a time


def plan_request(request: Request):
    source, _, anatomy = inspect_model(request.model)
    return source, anatomy, compressor_for(request).plan(anatomy, request)


def run_compress(request: Request, dry_run: bool = False, recipe: Recipe | None = None) -> CompressReport:
    """Compress (and heal, when ``recipe`` has a heal step); with ``dry_run`` only plan."""
    source, anatomy, plan = plan_request(request)
    check_calibration(request.calibration, anatomy, read_text=dry_run)  # a run reads it before the weights load
    report = CompressReport(plan, anatomy)
    if dry_run:
        return report
    recipe = recipe or Recipe.from_request(request)
    if streams(request, compressor_for(request).stream_refusal(plan) or stream_refusal(request, source, anatomy, recipe)):
        return run_streamed(request, source, anatomy, report, recipe)
    surgery = start_surgery(request, source, anatomy)
    result_model = operated_once(lambda: operate(surgery, request, plan, anatomy, report), request, recipe)
    card = partial(compress_card, request, report)
    modeling = {MODELING_FILE.name: MODELING_FILE.read_text(encoding="utf-8")}
    finish_surgery(surgery, result_model, request, anatomy, report, card, extra_files=modeling, recipe=recipe)
    return report


STREAM_SHARD_SIZE = "2GB"  # finished tensors wait in memory until their shard is complete


def run_streamed(request: Request, source, anatomy: AttentionAnatomy, report: CompressReport,
                 recipe: Recipe) -> CompressReport:
    """Compress with one source layer in memory at a time (``compress_stream``), written
    straight into the staged output in the source's dtype; the source and the output are scored a module at a time."""
    report.streamed = True
    surgery, config, dtype = start_streamed(request, source, anatomy)
    fingerprint = settings_fingerprint(recipe.model_dump(mode="json", exclude={"eval"}), surgery.windows, Path(source.path))
    with resumable_checkpoint(request.output, request.overwrite, fingerprint) as checkpoints:
        staging = checkpoints.directory
        with ui.progress_bar(f"Factorizing ({request.method}, streamed)", total=anatomy.num_layers, unit="layers") as advance:
            written, report.errors = compress_streamed(
                CheckpointReader(Path(source.path)), config, surgery.family, surgery.windows, report.plan, staging,
                dtype, STREAM_SHARD_SIZE, advance, surgery.device, checkpoints, request.seed)
        report.factorize_seconds = time.perf_counter() - surgery.started
        finish_streamed(staging, written, source, surgery, request, report, partial(compress_card, request, report),
                        recipe, {MODELING_FILE.name: MODELING_FILE.read_text(encoding="utf-8")})
    report.written = str(request.output)
    report.seconds = time.perf_counter() - surgery.started
    report.peak_memory_gb = peak_memory_gb()
    return report


def operate(surgery, request: Request, plan, anatomy, report: CompressReport) -> PreTrainedModel:
    """The method's statistics and factorization; the operated model (the report gets its plan and errors)."""
    model, family, windows = surgery.model, surgery.family, surgery.windows
    attentions = attention_layers(model, family)
    stats = input_statistics(model, attentions + [getattr(a, PROJECTIONS["o"]) for a in attentions], windows,
                             device=surgery.device)
    started = time.perf_counter()
    layer_stats = list(zip(stats[: len(attentions)], stats[len(attentions) :], strict=True))
    with ui.progress_bar(f"Factorizing ({request.method})", total=anatomy.num_layers, unit="layers") as advance:
        result = compressor_for(request).operate(model, family, layer_stats, plan, windows.shape[1], request.seed, advance)
    report.factorize_seconds = time.perf_counter() - started
    report.plan, report.errors = result.plan, result.errors
    return result.model


def compress_card(request: Request, report: CompressReport) -> CardInfo:
    """The method's card text, with the model, the command and the calibration."""
    text = method_of(report.plan).card_text(request, report.plan, report.anatomy)
    calib = request.calibration
    calibration = (f"calibration: {calib.tokens} tokens of the calibration part of {described_data(calib.data)}, "
                   f"windows of {calib.seq_len}; " + healing_note(report))
    return CardInfo(
        title=f"{request.model.ref} {text.title}",
        summary=text.summary,
        base_model=base_model_id(request.model.ref),
        tags=text.tags,
        command=command_line(),
        details=text.details + [calibration],
        figures=text.figures,
        sections=text.sections,
    )
