"""The one surgery pipeline, for every method (``convert`` and ``compress`` alike):
plan -> (dry run stops here) -> calibration windows -> the method's operation, one layer at a time (or on the
source loaded whole, where it cannot be read so) -> (healing, with both models loaded) -> ppl before/after ->
the checkpoint with its card and recipe.

What differs between methods is asked of the method (``methods/base.SurgeryMethod``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from attnsurg import ui
from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.heal import fitted_to_context
from attnsurg.info import inspect_model
from attnsurg.io.card import CardInfo
from attnsurg.io.load import layer_readable
from attnsurg.io.resume import resumable_checkpoint, settings_fingerprint
from attnsurg.methods.base import StreamTarget, SurgeryInputs, SurgeryReport
from attnsurg.pipelines.job import Job, read_paths
from attnsurg.requests import Calibration
from attnsurg.pipelines.card import base_model_id, command_line, healing_note, peak_memory_gb
from attnsurg.eval.long_context import check_long_context
from attnsurg.pipelines.finish import finish_streamed, finish_surgery
from attnsurg.pipelines.processes import operated_once
from attnsurg.pipelines.source import Surgery, check_calibration, load_source_model, start_streamed, start_surgery, streams, surgery_device

STREAM_SHARD_SIZE = "2GB"  # finished tensors wait in memory until their shard is complete


def planned(job: Job):
    """The source, its anatomy and the report holding the method's plan; nothing is loaded."""
    source, _, anatomy = inspect_model(job.recipe.model)
    method = job.method
    plan = method.plan(anatomy, job.settings)
    method.check_calibration(job.settings, job.recipe.calibration)
    return source, anatomy, method.report_type(plan, anatomy)


def run_surgery(job: Job, dry_run: bool = False) -> SurgeryReport:
    """Operate (and heal, when the recipe has a heal step); with ``dry_run`` only plan."""
    source, anatomy, report = planned(job)
    check_calibration(job.recipe.calibration, anatomy, read_text=dry_run)  # a run reads it before the weights load
    check_long_context(job.recipe.eval.long_context, anatomy.max_positions)
    if dry_run:
        return report
    job = replace(job, reads=read_paths(job.recipe, source))
    if job.recipe.heal is not None:
        job = replace(job, recipe=job.recipe.with_heal(fitted_to_context(job.recipe.heal, anatomy.max_positions)))
    if not streams(job.settings.stream, job.method.stream_refusal(job.settings, report.plan)):
        return run_loaded(job, source, anatomy, report)
    model = job.recipe.model
    with layer_readable(source, job.recipe.output, model.allow_pickle, model.trust_remote_code) as readable:
        if job.recipe.heal is None:
            return run_streamed(job, readable, anatomy, report)
        return run_streamed_then_healed(job, readable, anatomy, report)


def run_loaded(job: Job, source, anatomy: AttentionAnatomy, report: SurgeryReport) -> SurgeryReport:
    """The operation on the source loaded whole (``--no-stream``, or settings that need the whole model)."""
    surgery = start_surgery(job, source, anatomy)
    if job.recipe.heal is None:
        model = operate(surgery, job, report)
    else:
        model = operated_once(lambda shared: operate(surgery, job, report).save_pretrained(shared), job)
    finish_surgery(surgery, model, job, anatomy, report, lambda: card(job, report, surgery.calibration), job.method.extra_files())
    return report


def inputs_of(surgery: Surgery, job: Job) -> SurgeryInputs:
    return SurgeryInputs(surgery.family, surgery.windows, surgery.calibration, surgery.device, job.recipe.seed)


def operate(surgery: Surgery, job: Job, report: SurgeryReport) -> PreTrainedModel:
    """The method's operation on the loaded source (the report gets its time, plan and figures)."""
    started = time.perf_counter()
    with ui.progress_bar(job.method.progress_label(job.settings), total=report.anatomy.num_layers, unit="layers") as advance:
        model = job.method.operate_model(surgery.model, inputs_of(surgery, job), job.settings, report, advance)
    report.operation_seconds = time.perf_counter() - started
    return model


def run_streamed(job: Job, source, anatomy: AttentionAnatomy, report: SurgeryReport) -> SurgeryReport:
    """The operation with one source layer in memory at a time, written straight into the staged output in the
    source's dtype; the source and the output are scored a module at a time."""
    surgery, config, dtype, reader = start_streamed(job, source, anatomy)

    def finish(staging: Path, written: PretrainedConfig) -> None:
        finish_streamed(staging, written, source, surgery, job, report, lambda: card(job, report, surgery.calibration),
                        job.method.extra_files())

    stream_operation(job, source, surgery, reader, config, report, job.recipe.output, dtype, job.overwrite, finish)
    report.written = str(job.recipe.output)
    report.seconds = time.perf_counter() - surgery.started
    report.peak_memory_gb = peak_memory_gb()
    return report


def run_streamed_then_healed(job: Job, source, anatomy: AttentionAnatomy, report: SurgeryReport) -> SurgeryReport:
    """The operation one source layer at a time, written in float32 into the heal state (``operated_once``);
    then healing, which holds the student and its teacher (the source) whole."""
    surgery, config, _, reader = start_streamed(job, source, anatomy)

    def write(shared: Path) -> None:
        stream_operation(job, source, surgery, reader, config, report, shared, torch.float32, True,
                         lambda staging, written: written.save_pretrained(staging))

    model = operated_once(write, job)
    surgery.model = load_source_model(job.recipe.model, source)
    surgery.device = surgery_device(job.device, anatomy)
    finish_surgery(surgery, model, job, anatomy, report, lambda: card(job, report, surgery.calibration), job.method.extra_files())
    return report


def stream_operation(job: Job, source, surgery: Surgery, reader, config: PretrainedConfig, report: SurgeryReport,
                     output: Path, dtype: torch.dtype, overwrite: bool,
                     finish: Callable[[Path, PretrainedConfig], None]) -> None:
    """The method's streamed operation into ``output`` in ``dtype``, staged and resumable (``io.resume``);
    ``finish(staging, written config)`` completes the staged directory before it takes the output's place."""
    report.streamed = True
    surgery_step = job.recipe.model_copy(update={"steps": job.recipe.steps[:1]})  # healing does not change it
    fingerprint = settings_fingerprint(surgery_step.model_dump(mode="json", exclude={"eval"}), surgery.windows,
                                       source.files)
    with resumable_checkpoint(output, overwrite, fingerprint, job.reads) as checkpoints:
        target = StreamTarget(checkpoints.directory, dtype, STREAM_SHARD_SIZE, checkpoints)
        label = f"{job.method.progress_label(job.settings)} (streamed)"
        started = time.perf_counter()
        with ui.progress_bar(label, total=report.anatomy.num_layers, unit="layers") as advance:
            written = job.method.operate_streamed(reader, config, inputs_of(surgery, job),
                                                  job.settings, report, target, advance)
        report.operation_seconds = time.perf_counter() - started
        finish(target.directory, written)


def card(job: Job, report: SurgeryReport, calibration: Calibration) -> CardInfo:
    """The method's card text (``calibration`` as read), with the model and the command."""
    text = job.method.card_text(job.settings, report, calibration, healing_note(report))
    return CardInfo(
        title=f"{job.recipe.model.ref} {text.title}",
        summary=text.summary,
        base_model=base_model_id(job.recipe.model.ref),
        tags=text.tags,
        command=command_line(),
        details=text.details,
        figures=text.figures,
        sections=text.sections,
    )
