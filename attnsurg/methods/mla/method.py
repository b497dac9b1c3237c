"""``convert --to mla`` as a surgery method: its plan, the conversion of a loaded model or of one layer at a
time, and what it reports."""

from __future__ import annotations

from transformers import PretrainedConfig, PreTrainedModel

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.calibrate import short_prompt_starts
from attnsurg.methods import MethodSpec, register
from attnsurg.methods.base import CardText, Progress, StreamTarget, SurgeryInputs, SurgeryMethod, register_method
from attnsurg.methods.mla.conversion import convert
from attnsurg.methods.mla.plan import MLAPlan, full_budget, plan_mla, unsupported_reason
from attnsurg.methods.mla.report import (
    ConvertReport,
    engine_note,
    layer_error_lines, layer_error_records,
    mla_card_text,
    plan_rows,
    plan_table,
    refinement_of,
    split_line,
)
from attnsurg.methods.mla.split import check_measurable, split_candidates, streamed_split
from attnsurg.methods.mla.stream import convert_streamed
from attnsurg.methods.mla.settings import MLA_CALIBRATION, MLASettings
from attnsurg.requests import Calibration


class MLA(SurgeryMethod):
    names = ("mla",)
    settings = MLASettings
    plan_type = MLAPlan
    step = "convert"
    report_type = ConvertReport
    timed_step = "conversion"
    seconds_key = "convert_seconds"
    calibration = MLA_CALIBRATION

    def name_of(self, settings: MLASettings) -> str:
        return settings.to

    def step_label(self, settings: MLASettings) -> str:
        budget = f"kv_budget {settings.kv_budget}" if settings.kv_budget is not None else f"kv_rank {settings.kv_rank}"
        return f"convert to mla ({budget})"

    def progress_label(self, settings: MLASettings) -> str:
        return "Converting layers"

    def plan(self, anatomy: AttentionAnatomy, settings: MLASettings) -> MLAPlan:
        return plan_mla(anatomy, settings.kv_budget, settings.kv_rank, settings.rope_dim, settings.rope_layout,
                        settings.format, settings.engine, settings.nope_width, settings.rope_fold)

    def check_calibration(self, settings: MLASettings, calibration: Calibration) -> None:
        if settings.split == "measured":
            check_measurable(calibration.tokens // calibration.seq_len, settings.kv_rank, settings.rope_dim,
                             settings.rope_fold)

    def stream_refusal(self, settings: MLASettings, plan: MLAPlan) -> str | None:
        if settings.short_prompts and settings.token_weights == "received":
            return ("--token-weights received weighs whole windows, and --short-prompts (default 0.1) cuts them: "
                    "with --stream add --short-prompts 0 or drop --token-weights received")
        return None

    def operate_model(self, source: PreTrainedModel, inputs: SurgeryInputs, settings: MLASettings,
                      report: ConvertReport, progress: Progress = None) -> PreTrainedModel:
        result = convert(
            source, inputs.family, inputs.windows, report.plan, settings.weighted,
            refinement_of(settings, inputs.calibration), progress=progress,
            starts=self.starts(settings, inputs), device=inputs.device,
            received=settings.token_weights == "received", candidates=self.split_candidates(settings, report.anatomy),
        )
        report.plan, report.layer_errors, report.split = result.plan, result.layer_errors, result.split
        return result.model

    def starts(self, settings: MLASettings, inputs: SurgeryInputs, streamed: bool = False):
        """Where the calibration windows' prompts start (``--short-prompts``); a streamed run without short
        prompts runs plain windows."""
        if streamed and not settings.short_prompts:
            return None
        return short_prompt_starts(inputs.windows, settings.short_prompts, inputs.seed)

    def split_candidates(self, settings: MLASettings, anatomy: AttentionAnatomy) -> list[MLAPlan] | None:
        """The plans ``--split measured`` compares, or None for the rule's plan alone."""
        if settings.split != "measured":
            return None
        return split_candidates(anatomy, settings.kv_budget, layout=settings.rope_layout, format=settings.format,
                                engine=settings.engine, nope_width=settings.nope_width)

    def operate_streamed(self, reader, source_config: PretrainedConfig, inputs: SurgeryInputs, settings: MLASettings,
                         report: ConvertReport, target: StreamTarget, progress: Progress = None) -> PretrainedConfig:
        if candidates := self.split_candidates(settings, report.anatomy):
            report.split = streamed_split(reader, source_config, inputs.family, inputs.windows, candidates,
                                          settings.weighted, inputs.device, self.starts(settings, inputs, streamed=True),
                                          settings.token_weights == "received")
            report.plan = report.split.chosen
        written, report.layer_errors = convert_streamed(
            reader, source_config, inputs.family, inputs.windows, report.plan, target.directory, settings.weighted,
            refinement_of(settings, inputs.calibration), target.dtype, target.max_shard_size, progress, inputs.device,
            target.checkpoints, settings.token_weights == "received", self.starts(settings, inputs, streamed=True))
        return written

    def card_text(self, settings: MLASettings, report: ConvertReport, calibration: Calibration,
                  healing: str) -> CardText:
        return mla_card_text(settings, report, calibration, healing)

    def report_record(self, report: ConvertReport) -> dict:
        return {"plan": plan_rows(report.plan, report.anatomy), "layer_errors": layer_error_records(report),
                "split": report.split.record() if report.split else None, "split_reason": split_line(report)}

    def report_text(self, model: str, report: ConvertReport, dry_run: bool) -> list:
        return [plan_table(model, report), f"split: {split_line(report)}", *engine_note(report.plan)]

    def result_text(self, report: ConvertReport) -> list:
        return layer_error_lines(report)


register(MethodSpec("mla", "GQA/MHA -> DeepSeek-style latent attention (DeepseekV3 checkpoint)", unsupported_reason,
                    full_budget=full_budget))
register_method(MLA())
