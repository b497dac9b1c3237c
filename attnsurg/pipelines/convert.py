"""``attnsurg convert``: load -> plan -> calibrate -> fit -> evaluate -> write, for MLA."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedModel

from attnsurg import ui
from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.calibrate import SHORT_PROMPT_TOKENS, short_prompt_starts
from attnsurg.heal import HealReport
from attnsurg.info import inspect_model
from attnsurg.io.card import CardInfo
from attnsurg.io.lazy import CheckpointReader
from attnsurg.io.resume import resumable_checkpoint, settings_fingerprint
from attnsurg.methods.mla import (
    REFINE_STEP_QUERIES,
    REFINE_STEP_TOKENS,
    LayerError,
    MLAPlan,
    Refinement,
    convert,
    plan_mla,
)
from attnsurg.methods.mla.split import SplitChoice, check_measurable, split_candidates
from attnsurg.methods.mla.stream import convert_streamed
from attnsurg.pipelines.steps import (
    Surgery,
    base_model_id,
    check_calibration,
    command_line,
    described_data,
    finish_streamed,
    finish_surgery,
    healing_note,
    operated_once,
    peak_memory_gb,
    start_streamed,
    start_surgery,
    stream_refusal,
    streams,
)
from attnsurg.recipe import ConvertMLA, Recipe, refined_share


@dataclass
class ConvertReport:
    plan: MLAPlan
    anatomy: AttentionAnatomy
    written: str | None = None
    seconds: float = 0.0
    convert_seconds: float = 0.0  # calibration, closed form and refinement: not loading, scoring or writing
    peak_memory_gb: float = 0.0
    ppl_before: float | None = None
    ppl_after: float | None = None
    domains: dict[str, tuple[float, float]] = field(default_factory=dict)  # ppl before/after off the calibration text
    heal: HealReport | None = None
    layer_errors: list[LayerError] = field(default_factory=list)
    split: SplitChoice | None = None  # the splits compared (``--split measured``)
    streamed: bool = False  # the source read one decoder layer at a time

    @property
    def mean_layer_error(self) -> tuple[float, float] | None:
        """Mean relative layer error of the closed form and of the kept weights, on the refinement windows."""
        if not self.layer_errors:
            return None
        n = len(self.layer_errors)
        return sum(e.before for e in self.layer_errors) / n, sum(e.after for e in self.layer_errors) / n

    @property
    def mean_held_out_error(self) -> tuple[float, float] | None:
        """The same on the held-out windows refinement never trained on."""
        held = [e for e in self.layer_errors if e.held_before is not None]
        if not held:
            return None
        return sum(e.held_before for e in held) / len(held), sum(e.held_after for e in held) / len(held)


def plan_rows(plan: MLAPlan, anatomy: AttentionAnatomy) -> list[dict]:
    """Per layer (identical in every layer): the dry-run plan."""
    before = anatomy.attention_parameters // anatomy.num_layers
    after = plan.attention_parameters(anatomy.hidden_size)
    return [
        {
            "layer": i,
            "latent_rank": plan.kv_rank,
            "norm_channel": plan.exact,
            "format": plan.format,
            "rope_dims": plan.rope_dim,
            "rope_fold": plan.rope_fold,
            "qk_nope_dim": plan.written_dims[0],
            "v_head_dim": plan.written_dims[1],
            "kv_values_before": plan.original_values,
            "kv_values_after": plan.cached_values,
            "attention_params_before": before,
            "attention_params_after": after,
        }
        for i in range(plan.num_layers)
    ]


def plan_request(request: ConvertMLA):
    source, _, anatomy = inspect_model(request.model)
    plan = plan_mla(anatomy, request.kv_budget, request.kv_rank, request.rope_dim, request.rope_layout, request.format,
                    request.engine, request.nope_width, request.rope_fold)
    if request.split == "measured":
        check_measurable(request.calibration.tokens // request.calibration.seq_len, request.kv_rank, request.rope_dim,
                         request.rope_fold)
    return source, anatomy, plan


def mla_stream_refusal(request: ConvertMLA, source, anatomy: AttentionAnatomy, recipe: Recipe) -> str | None:
    """Why this conversion cannot read the source a layer at a time (``steps.stream_refusal``, and what MLA's
    streamed conversion does not do yet), or None."""
    if request.split == "measured":
        return "--split measured compares splits on the whole model's statistics; with --stream give --rope-dim"
    if request.short_prompts:
        return "--short-prompts is not available with --stream yet; drop one of them"
    return stream_refusal(request, source, anatomy, recipe)


def split_candidates_of(request: ConvertMLA, anatomy: AttentionAnatomy) -> list[MLAPlan] | None:
    """The plans ``--split measured`` compares, or None for the rule's plan alone."""
    if request.split != "measured":
        return None
    return split_candidates(anatomy, request.kv_budget, layout=request.rope_layout, format=request.format,
                            engine=request.engine, nope_width=request.nope_width)


def refinement_of(request: ConvertMLA) -> Refinement:
    tokens = refined_share(request.calibration.tokens) if request.refine_tokens is None else request.refine_tokens
    return Refinement(request.refine_steps, tokens, request.refine_lr, request.refine_schedule)


def refinement_note(refinement: Refinement, calibration_tokens: int) -> str:
    return (f"then {refinement.steps} Adam steps per layer ({refinement.schedule} learning rate from {refinement.lr:g}), "
            f"each scoring {REFINE_STEP_QUERIES} query positions of the next {REFINE_STEP_TOKENS} of the first "
            f"{min(refinement.tokens, calibration_tokens)} tokens against the original layer's output, relative to the "
            "original stream's size at each token; a layer no step helps is retried at a quarter of the rate, twice at most")


def run_convert(request: ConvertMLA, dry_run: bool = False, recipe: Recipe | None = None) -> ConvertReport:
    """Convert (and heal, when ``recipe`` has a heal step); with ``dry_run`` only plan."""
    source, anatomy, plan = plan_request(request)
    check_calibration(request.calibration, anatomy, read_text=dry_run)  # a run reads it before the weights load
    report = ConvertReport(plan, anatomy)
    if dry_run:
        return report
    recipe = recipe or Recipe.from_request(request)
    if streams(request, mla_stream_refusal(request, source, anatomy, recipe)):
        return run_streamed(request, source, anatomy, report, recipe)
    surgery = start_surgery(request, source, anatomy)
    model = operated_once(lambda: operate(surgery, request, plan, report), request, recipe)
    finish_surgery(surgery, model, request, anatomy, report, lambda: mla_card(request, report), recipe=recipe)
    return report


def operate(surgery: Surgery, request: ConvertMLA, plan: MLAPlan, report: ConvertReport) -> PreTrainedModel:
    """The conversion itself, in memory (the report gets its time, plan and layer errors)."""
    started = time.perf_counter()
    with ui.progress_bar("Converting layers", total=plan.num_layers, unit="layers") as advance:
        starts = short_prompt_starts(surgery.windows, request.short_prompts, request.seed)
        result = convert(
            surgery.model, surgery.family, surgery.windows, plan, request.weighted, refinement_of(request),
            progress=advance, starts=starts, device=surgery.device, received=request.token_weights == "received",
            candidates=split_candidates_of(request, report.anatomy),
        )
    report.convert_seconds = time.perf_counter() - started
    report.plan, report.layer_errors, report.split = result.plan, result.layer_errors, result.split
    return result.model


STREAM_SHARD_SIZE = "2GB"  # finished tensors wait in memory until their shard is complete


def run_streamed(request: ConvertMLA, source, anatomy: AttentionAnatomy, report: ConvertReport,
                 recipe: Recipe) -> ConvertReport:
    """Convert with one source layer in memory at a time (``mla.stream``), written straight into the staged
    output in the source's dtype; the source and the output are scored a module at a time."""
    report.streamed = True
    surgery, config, dtype = start_streamed(request, source, anatomy)
    fingerprint = settings_fingerprint(recipe.model_dump(mode="json", exclude={"eval"}), surgery.windows, Path(source.path))
    with resumable_checkpoint(request.output, request.overwrite, fingerprint) as checkpoints:
        staging = checkpoints.directory
        with ui.progress_bar("Converting layers (streamed)", total=report.plan.num_layers, unit="layers") as advance:
            written, report.layer_errors = convert_streamed(
                CheckpointReader(Path(source.path)), config, surgery.family, surgery.windows,
                report.plan, staging, request.weighted, refinement_of(request), dtype, STREAM_SHARD_SIZE, advance,
                surgery.device, checkpoints, request.token_weights == "received")
        report.convert_seconds = time.perf_counter() - surgery.started
        finish_streamed(staging, written, source, surgery, request, report, lambda: mla_card(request, report), recipe)
    report.written = str(request.output)
    report.seconds = time.perf_counter() - surgery.started
    report.peak_memory_gb = peak_memory_gb()
    return report


LAYOUT_NOTES = {
    "standard": "The RoPE key uses the standard interleaved layout (`rope_interleave: true`) with plain RoPE at "
    "the kept frequencies (`rope_theta` adjusted).",
    "flexible": "The RoPE key uses the flexible layout: a frequency may appear once per original KV head, "
    "expressed with transformers' `longrope` per-pair factors, which DeepSeek loaders outside transformers do "
    "not read (they expect plain or YaRN RoPE); convert with `--rope-layout standard` for other engines.",
}
FORMAT_NOTES = {
    "native": "Engine-native format: no attention biases and a fitted latent RMSNorm, the layout of DeepSeek's own "
    "checkpoints; `attnsurg export --gguf` writes it for llama.cpp.",
    "exact": "Exact format: a constant latent channel (an attention bias) neutralises the latent RMSNorm, so a full "
    "budget reproduces the source; it runs in transformers (tested). llama.cpp's DeepSeek2 graph has no attention "
    "biases (attnsurg export refuses it) and vLLM's and SGLang's loaders build these projections without biases "
    "(read from their source). Convert with `--format native` for other engines.",
}


def rope_counts_note(plan: MLAPlan) -> str:
    counts, unit = plan.counts, "frequency" if plan.rope_fold == 1 else (
        f"group of {plan.rope_fold} neighbouring frequencies (FreqFold: each group rotates at its highest)")
    kept = f"{counts[0]} in each" if len(set(counts)) == 1 else str(list(counts))
    return f"RoPE components kept per {unit}, highest first: {kept}"


def engine_note(plan: MLAPlan) -> list[str]:
    nope, v = plan.written_dims
    if plan.engine != "vllm":
        return []
    return [f"laid out for vLLM: (qk_nope, rope, v) head dims ({nope}, {plan.rope_dim}, {v}) from the fitted "
            f"({plan.qk_nope_dim}, {plan.rope_dim}, {plan.head_dim}) by zero padding, lm_head stored untied"]


def short_prompts_note(share: float) -> str:
    if not share:
        return ""
    low, high = SHORT_PROMPT_TOKENS
    return f", the last {share:.0%} of each cut into prompts of {low}-{high} tokens run on their own"


def qk_norm_note(anatomy) -> list[str]:
    if not anatomy.qk_norm:
        return []
    return ["q/k norms: the source normalises each head's queries and keys token by token, which MLA's shared "
            "latent has no place for; the closed form linearises the norms at each head's mean square and "
            "refinement fits the rest against the real layer, so even a full budget is approximate"]


def mla_card(request: ConvertMLA, report: ConvertReport) -> CardInfo:
    plan, anatomy = report.plan, report.anatomy
    calib = request.calibration
    data = described_data(calib.data)
    figures = [
        {"metric": "KV values per token per layer", "before": str(plan.original_values), "after": str(plan.cached_values)},
        {"metric": "KV bytes per token (bf16)", "before": f"{anatomy.kv_bytes_per_token('bfloat16'):,}",
         "after": f"{plan.num_layers * plan.cached_values * 2:,}"},
    ]
    if report.mean_layer_error:
        before, after = report.mean_layer_error
        figures.append({"metric": "mean relative layer error against the original residual stream (refinement windows)",
                        "before": f"{before:.4f}", "after": f"{after:.4f}"})
    if report.mean_held_out_error:
        before, after = report.mean_held_out_error
        figures.append({"metric": "the same on held-out calibration windows (never trained on; refinement keeps the "
                        "steps where it is lowest)", "before": f"{before:.4f}", "after": f"{after:.4f}"})
    return CardInfo(
        title=f"{request.model.ref} as multi-head latent attention (DeepseekV3)",
        summary=(
            "Attention converted from grouped-query to DeepSeek-style multi-head latent attention by attnsurg. "
            "Loads with stock transformers (`model_type: deepseek_v3`, no remote code). " + FORMAT_NOTES[plan.format]
            + " " + LAYOUT_NOTES[plan.layout]
        ),
        base_model=base_model_id(request.model.ref),
        tags=["mla", "multi-head-latent-attention", "deepseek_v3"],
        command=command_line(),
        details=[
            f"KV budget: {plan.cached_values} of {plan.original_values} values per layer per token "
            f"(latent {plan.kv_rank}{' + 1 norm channel' if plan.exact else ''} + {plan.rope_dim} RoPE dims, "
            f"{plan.format} format, {plan.layout} layout; "
            f"{rope_counts_note(plan)})",
            *([f"split: {report.split.reason()}"] if report.split else []),
            *engine_note(plan),
            *qk_norm_note(anatomy),
            f"calibration: {calib.tokens} tokens of the calibration part of {data}, windows of {calib.seq_len}"
            + short_prompts_note(request.short_prompts),
            f"latent fit: closed form, {'consumer-weighted' if request.weighted else 'plain'} PCA in float64"
            + (", calibration tokens weighted by the attention they receive" if request.token_weights == "received" else "")
            + "; "
            + (refinement_note(refinement_of(request), calib.tokens) if request.refine_steps else "no refinement")
            + "; " + healing_note(report),
            "perplexity on long windows does not show what short prompts lose (on the demo model at 50% KV, short "
            "factual answers fell further than perplexity did): check them with `attnsurg eval tasks SOURCE THIS "
            "--tasks facts,cloze,passkey` before you ship",
        ],
        figures=figures,
    )
