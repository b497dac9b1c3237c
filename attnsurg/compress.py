"""``attnsurg compress``: plan -> load -> calibrate -> factorize -> evaluate -> write.

Low-rank methods (svd, asvd, svdllm) and tensor methods (tucker, cp, stacked tucker) share this pipeline; their plans
answer the same questions (units, ranks, parameters, FLOPs, KV values).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedModel

from attnsurg import ui
from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.calibrate import attention_layers, input_statistics
from attnsurg.info import inspect_model
from attnsurg.heal import HealReport
from attnsurg.io.card import CardInfo
from attnsurg.methods.headtensor import (
    HeadTensorPlan,
    compress_head_tensor,
    plan_head_tensor,
)
from attnsurg.methods.loki import LokiPlan, apply_loki, plan_loki
from attnsurg.methods.stacked_tucker import StackedTuckerPlan, compress_stacked_tucker, plan_stacked_tucker
from attnsurg.io.lazy import CheckpointReader
from attnsurg.io.resume import resumable_checkpoint, settings_fingerprint
from attnsurg.methods.lowrank import PROJECTIONS, LowRankPlan, compress, plan_lowrank
from attnsurg.methods.compress_stream import compress_streamed
from attnsurg.modeling import MODELING_FILE
from attnsurg.pipeline import (
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
)
from attnsurg.recipe import CompressHeadTensor, CompressLoki, CompressLowRank, Recipe

Plan = LowRankPlan | HeadTensorPlan | StackedTuckerPlan
Request = CompressLowRank | CompressHeadTensor | CompressLoki


@dataclass
class CompressReport:
    plan: Plan | LokiPlan
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


def projection_flops(plan: Plan) -> tuple[int, int]:
    """FLOPs per token in the targeted projections, before and after."""
    return plan.flops_before(), plan.flops_after()


def unit_params(plan: Plan, index: int, after: bool) -> int:
    unit, ranks = plan.units[index], plan.ranks[index]
    if isinstance(plan, (HeadTensorPlan, StackedTuckerPlan)):
        return plan.params(unit, ranks if after else None)
    return unit.params(ranks if after else None)


def plan_columns(plan: Plan) -> list[str]:
    """The rank columns of a plan's table: one per targeted projection, or one k/v latent or stacked column."""
    if plan.kv_latent:
        return ["kv"]
    return ["qkvo"] if isinstance(plan, StackedTuckerPlan) else list(plan.targets)


COLUMN_TITLES = {"kv": "k/v latent", "qkvo": "q,k,v,o stacked (head_dim x hidden)"} | PROJECTIONS


def rank_rows(plan: Plan, labels: bool = True) -> list[dict]:
    """Per layer: each unit's rank label ("dense", "255", "9x64x140"), or with ``labels=False`` its raw ranks
    (None when dense), with parameters before/after."""
    rows: dict[int, dict] = {}
    for i, unit in enumerate(plan.units):
        row = rows.setdefault(unit.layer, {"layer": unit.layer, "params_before": 0, "params_after": 0})
        row[unit.name] = plan.rank_label(i) if labels else plan.ranks[i]
        row["params_before"] += unit_params(plan, i, after=False)
        row["params_after"] += unit_params(plan, i, after=True)
    return list(rows.values())


def plan_request(request: Request):
    source, _, anatomy = inspect_model(request.model)
    if isinstance(request, CompressLoki):
        plan = plan_loki(anatomy, request.rank, request.top_k, request.basis, request.variance)
    elif isinstance(request, CompressHeadTensor) and request.stacked:
        plan = plan_stacked_tucker(anatomy, request.targets, request.ratio, request.ranks, request.weighted)
    elif isinstance(request, CompressHeadTensor):
        plan = plan_head_tensor(anatomy, request.method, request.targets, request.ratio, request.ranks, request.weighted)
    else:
        plan = plan_lowrank(
            anatomy, request.method, request.targets, request.ratio, request.rank,
            request.kv_latent, request.allocate, request.weighted,
        )
    return source, anatomy, plan


def run_compress(request: Request, dry_run: bool = False, recipe: Recipe | None = None) -> CompressReport:
    """Compress (and heal, when ``recipe`` has a heal step); with ``dry_run`` only plan."""
    source, anatomy, plan = plan_request(request)
    check_calibration(request.calibration, anatomy, read_text=dry_run)  # a run reads it before the weights load
    report = CompressReport(plan, anatomy)
    if dry_run:
        return report
    if getattr(request, "stream", False):
        return run_streamed(request, source, anatomy, report, recipe or Recipe.from_request(request))
    surgery = start_surgery(request, source, anatomy)
    result_model = operated_once(lambda: operate(surgery, request, plan, anatomy, report), request, recipe)
    card = (lambda: loki_card(request, report)) if isinstance(plan, LokiPlan) else (lambda: lowrank_card(request, report))
    modeling = {MODELING_FILE.name: MODELING_FILE.read_text(encoding="utf-8")}
    finish_surgery(surgery, result_model, request, anatomy, report, card, extra_files=modeling, recipe=recipe)
    return report


STREAM_SHARD_SIZE = "2GB"  # finished tensors wait in memory until their shard is complete


def run_streamed(request: Request, source, anatomy: AttentionAnatomy, report: CompressReport,
                 recipe: Recipe) -> CompressReport:
    """Compress with one source layer in memory at a time (``compress_stream``), written
    straight into the staged output in the source's dtype. Nothing is scored: that would load both models whole."""
    surgery, config, dtype = start_streamed(request, source, anatomy, recipe)
    fingerprint = settings_fingerprint(recipe.model_dump(mode="json", exclude={"eval"}), surgery.windows, Path(source.path))
    with resumable_checkpoint(request.output, request.overwrite, fingerprint) as checkpoints:
        staging = checkpoints.directory
        with ui.progress_bar(f"Factorizing ({request.method}, streamed)", total=anatomy.num_layers, unit="layers") as advance:
            written, report.errors = compress_streamed(
                CheckpointReader(Path(source.path)), config, surgery.family, surgery.windows, report.plan, staging,
                dtype, STREAM_SHARD_SIZE, advance, surgery.device, checkpoints, request.seed)
        report.factorize_seconds = time.perf_counter() - surgery.started
        card = loki_card(request, report) if isinstance(report.plan, LokiPlan) else lowrank_card(request, report)
        finish_streamed(staging, written, source, surgery, card, recipe,
                        {MODELING_FILE.name: MODELING_FILE.read_text(encoding="utf-8")})
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
        if isinstance(plan, LokiPlan):
            result = None
            result_model = apply_loki(model, family, stats[: len(attentions)], plan, windows.shape[1])
        elif isinstance(plan, HeadTensorPlan):
            result = compress_head_tensor(model, family, layer_stats, plan, request.seed, windows.shape[1], progress=advance)
        elif isinstance(plan, StackedTuckerPlan):
            result = compress_stacked_tucker(model, family, layer_stats, plan, request.seed, windows.shape[1], progress=advance)
        else:
            result = compress(model, family, layer_stats, plan, windows.shape[1], progress=advance)
    report.factorize_seconds = time.perf_counter() - started
    if result is not None:
        result_model, report.plan, report.errors = result.model, result.plan, result.errors
    return result_model


def loki_card(request: CompressLoki, report: CompressReport) -> CardInfo:
    plan, calib = report.plan, request.calibration
    data = described_data(calib.data)
    top_k = f"{plan.top_k:g} of each query's context" if isinstance(plan.top_k, float) else f"{plan.top_k} keys"
    figures = [{"metric": "KV bytes per token (bf16)", "before": f"{report.anatomy.kv_bytes_per_token('bfloat16'):,}",
                "after": f"{report.anatomy.kv_bytes_per_token('bfloat16'):,} (keys cached rotated, full width)"}]
    return CardInfo(
        title=f"{request.model.ref} with Loki top-k attention (rank {plan.rank_label()}, top-k {top_k})",
        summary=(
            "Every layer scores keys with their first principal coordinates and attends exactly over the best "
            "ones (Loki). The weights are the original's; the checkpoint adds one PCA basis per layer and KV head."
        ),
        base_model=base_model_id(request.model.ref),
        tags=["loki", "top-k-attention"],
        command=command_line(),
        details=[
            f"rank {plan.rank_label()} of head dim {plan.head_dim}; top-k {top_k} (the current token always kept); "
            f"{plan.basis} key basis",
            f"calibration: {calib.tokens} tokens of the calibration part of {data}, windows of {calib.seq_len}; " + healing_note(report),
        ],
        figures=figures,
    )


def rank_table(plan: Plan) -> str:
    names = plan_columns(plan)
    header = "| layer | " + " | ".join(COLUMN_TITLES[n] for n in names) + " |"
    lines = [header, "|---" * (len(names) + 1) + "|"]
    for row in rank_rows(plan):
        lines.append(f"| {row['layer']} | " + " | ".join(row[n] for n in names) + " |")
    if isinstance(plan, (HeadTensorPlan, StackedTuckerPlan)):
        lines.append("\n" + RANK_NOTES["stacked" if isinstance(plan, StackedTuckerPlan) else plan.method])
    return "\n".join(lines)


RANK_NOTES = {
    "tucker": "Tucker ranks are heads x head_dim x hidden; the hidden factor is computed once per token for all heads.",
    "cp": "CP rank R: one shared hidden -> R projection per token, a mixing vector per head, one R -> head_dim map.",
    "stacked": "Stacked Tucker ranks are head_dim x hidden: one hidden factor per layer, computed once per token for "
               "q, k and v of every head and shared by o; one core per projection and head.",
}


def budget_details(request: Request, plan: Plan) -> str:
    if isinstance(plan, (HeadTensorPlan, StackedTuckerPlan)):
        budget = f"ratio {request.ratio}" if request.ratio is not None else f"ranks {','.join(map(str, request.ranks))}"
        split = "; Tucker mode ranks chosen per projection by HOSVD error" if plan.choose_ranks else ""
        if isinstance(plan, StackedTuckerPlan):
            split = "; q, k, v and o of each layer stacked in one decomposition (TensorLLM layout)"
        return f"budget: {budget} (fraction of the targeted parameters kept; achieved {plan.kept_fraction:.3f}){split}"
    budget = f"ratio {request.ratio}" if request.ratio is not None else f"rank {request.rank}"
    kind = "fraction of the KV cache kept" if plan.kv_latent else "fraction of the targeted parameters kept"
    spread = "allocated over layers by truncation energy" if plan.allocate else "uniform ranks"
    return f"budget: {budget} ({kind}; achieved {plan.kept_fraction:.3f}), {spread}"


def fit_note(plan: Plan) -> str:
    if isinstance(plan, StackedTuckerPlan):
        return "; alternating least squares on the calibration statistics, from TensorLLM's data-free factors"
    return "; fitted to the whitened calibration inputs" if isinstance(plan, HeadTensorPlan) else ""


def lowrank_card(request: Request, report: CompressReport) -> CardInfo:
    plan, anatomy = report.plan, report.anatomy
    calib = request.calibration
    data = described_data(calib.data)
    flops_before, flops_after = projection_flops(plan)
    tensor = isinstance(plan, (HeadTensorPlan, StackedTuckerPlan))
    kv_after = plan.kv_values_after()
    figures = [
        {"metric": "parameters in the targeted projections", "before": f"{plan.params_before():,}", "after": f"{plan.params_after():,}"},
        {"metric": "total parameters", "before": f"{anatomy.total_parameters:,}",
         "after": f"{anatomy.total_parameters - plan.params_before() + plan.params_after():,}"},
        {"metric": "FLOPs per token in the targeted projections", "before": f"{flops_before:,}", "after": f"{flops_after:,}"},
        {"metric": "KV values per token (all layers)", "before": f"{anatomy.kv_values_per_token:,}", "after": f"{kv_after:,}"},
        {"metric": "KV bytes per token (bf16)", "before": f"{anatomy.kv_bytes_per_token('bfloat16'):,}", "after": f"{kv_after * 2:,}"},
    ]
    kv_note = (
        " k and v share one cached latent per layer (rebuilt to K and V at every step, RoPE applied after), so "
        "the KV cache holds the latent only; rebuilding costs 2 x rank x 2 G d FLOPs per cached token per step."
        if plan.kv_latent else ""
    )
    if isinstance(plan, StackedTuckerPlan) and plan.kv_values_after() < anatomy.kv_values_per_token:
        kv_note = (" Where a layer's hidden rank is below the K and V width, its cache holds the shared hidden "
                   "coordinates x A (rebuilt to K and V at every step, RoPE applied after).")
    return CardInfo(
        title=f"{request.model.ref} with {'tensor-decomposed' if tensor else 'low-rank'} attention ({plan.method})",
        summary=(
            f"Attention projections factorized by attnsurg ({plan.method}).{kv_note}"
        ),
        base_model=base_model_id(request.model.ref),
        tags=[plan.method, "tensor-decomposition" if tensor else "low-rank"],
        command=command_line(),
        details=[
            budget_details(request, plan),
            f"targets: {', '.join(PROJECTIONS[t] for t in plan.targets)}"
            + fit_note(plan) + f"; consumer-weighted: {plan.weighted}",
            f"calibration: {calib.tokens} tokens of the calibration part of {data}, windows of {calib.seq_len}; " + healing_note(report),
        ],
        figures=figures,
        sections={"Ranks per module": rank_table(plan)},
    )
