"""What a conversion to MLA reports: ``ConvertReport``, its model card, the plan table and lines the command
prints, and its ``--json`` rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rich.table import Table

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.calibrate import SHORT_PROMPT_TOKENS
from attnsurg.methods.base import CardText, SurgeryReport
from attnsurg.methods.mla.fit import closed_form_labels
from attnsurg.methods.mla.plan import MLAPlan, split_reason
from attnsurg.methods.mla.refine import REFINE_STEP_QUERIES, REFINE_STEP_TOKENS, LayerError, Refinement
from attnsurg.methods.mla.split import SplitChoice
from attnsurg.methods.mla.settings import MLASettings, refined_share
from attnsurg.requests import Calibration


@dataclass
class ConvertReport(SurgeryReport):
    """A conversion's report: besides every surgery's figures, each refined layer's output error and the splits
    compared (``--split measured``)."""

    plan: MLAPlan
    layer_errors: list[LayerError] = field(default_factory=list)
    split: SplitChoice | None = None

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


def refinement_of(settings: MLASettings, calibration: Calibration) -> Refinement:
    """Refinement as the settings ask: on their tokens, or the first half of the calibration's."""
    tokens = refined_share(calibration.tokens) if settings.refine_tokens is None else settings.refine_tokens
    return Refinement(settings.refine_steps, tokens, settings.refine_lr, settings.refine_schedule)


def refinement_note(refinement: Refinement, calibration_tokens: int) -> str:
    return (f"then {refinement.steps} Adam steps per layer ({refinement.schedule} learning rate from {refinement.lr:g}), "
            f"each scoring {REFINE_STEP_QUERIES} query positions of the next {REFINE_STEP_TOKENS} of the first "
            f"{min(refinement.tokens, calibration_tokens)} tokens against the original layer's output, relative to the "
            "original stream's size at each token; a layer no step helps is retried at a quarter of the rate, twice at most")


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
    width = plan.cached_values
    cpu = ("vLLM's CPU build decodes this width (run on the demo at full KV heads: greedy tokens and prompt "
           "log-probs equal to transformers'; turn its "
           "rotary op off, `compilation_config={\"custom_ops\": [\"all\", \"-rotary_embedding\"]}`, which "
           "computes wrong values for DeepSeek's q/k)" if width == 576 else
           f"vLLM's CPU build decodes width 576 only, not this {width} (its GPU MLA backends take it: read, not run)")
    return [f"laid out for vLLM: (qk_nope, rope, v) head dims ({nope}, {plan.rope_dim}, {v}) from the fitted "
            f"({plan.qk_nope_dim}, {plan.rope_dim}, {plan.head_dim}) by zero padding, lm_head stored untied; {cpu}"]


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


def mla_card_text(settings: MLASettings, report: ConvertReport, calibration: Calibration, healing: str) -> CardText:
    plan, anatomy = report.plan, report.anatomy
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
    return CardText(
        title="as multi-head latent attention (DeepseekV3)",
        summary=(
            "Attention converted from grouped-query to DeepSeek-style multi-head latent attention by attnsurg. "
            "Loads with stock transformers (`model_type: deepseek_v3`, no remote code). " + FORMAT_NOTES[plan.format]
            + " " + LAYOUT_NOTES[plan.layout]
        ),
        tags=["mla", "multi-head-latent-attention", "deepseek_v3"],
        details=[
            f"KV budget: {plan.cached_values} of {plan.original_values} values per layer per token "
            f"(latent {plan.kv_rank}{' + 1 norm channel' if plan.exact else ''} + {plan.rope_dim} RoPE dims, "
            f"{plan.format} format, {plan.layout} layout; "
            f"{rope_counts_note(plan)})",
            f"split: {split_line(report)}",
            *engine_note(plan),
            *qk_norm_note(anatomy),
            f"calibration: {calibration.tokens} tokens of the calibration part of {calibration.data.described()}, "
            f"windows of {calibration.seq_len}" + short_prompts_note(settings.short_prompts),
            f"latent fit: closed form, {'consumer-weighted' if settings.weighted else 'plain'} PCA in float64"
            + (", calibration tokens weighted by the attention they receive" if settings.token_weights == "received" else "")
            + "; "
            + (refinement_note(refinement_of(settings, calibration), calibration.tokens) if settings.refine_steps
               else "no refinement")
            + "; " + healing,
            "perplexity on long windows does not show what short prompts lose (on the demo model at 50% KV, short "
            "factual answers fell further than perplexity did): check them with `attnsurg eval tasks SOURCE THIS "
            "--tasks facts,cloze,passkey` before you ship",
        ],
        figures=figures,
    )


def split_line(report: ConvertReport) -> str:
    """Why the budget splits as it does: the measured candidates' errors, or the rule."""
    return report.split.reason() if report.split else split_reason(report.plan)


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


def plan_table(model: str, report: ConvertReport) -> Table:
    """The plan, identical in every layer, as the command prints it."""
    plan = report.plan
    engine = f", laid out for {plan.engine}" if plan.engine else ""
    title = f"MLA plan for {model}, {plan.format} format, {plan.layout} RoPE layout{engine} (identical in every layer)"
    table = Table(title=title, title_justify="left")
    for column in ("layers", "latent rank", "RoPE dims", "qk nope / v dims", "KV values/token", "attention params/layer"):
        table.add_column(column, justify="right")
    rows = plan_rows(plan, report.anatomy)
    r = rows[0]
    table.add_row(
        f"0-{len(rows) - 1}", f"{r['latent_rank']}" + (" + 1 norm" if r["norm_channel"] else ""), str(r["rope_dims"]),
        f"{r['qk_nope_dim']} / {r['v_head_dim']}", f"{r['kv_values_before']} -> {r['kv_values_after']}",
        f"{r['attention_params_before']:,} -> {r['attention_params_after']:,}",
    )
    return table


def layer_error_lines(report: ConvertReport) -> list[str]:
    """The refined layers' mean errors, on the windows refinement trained on and on the held-out ones."""
    lines = []
    if report.mean_layer_error:
        before, after = report.mean_layer_error
        lines.append(f"mean relative layer error against the original residual stream: {before:.4f} -> {after:.4f} "
                     "(refinement windows)")
    if report.mean_held_out_error:
        before, after = report.mean_held_out_error
        steps = sum(e.steps for e in report.layer_errors) / len(report.layer_errors)
        lines.append(f"on held-out calibration windows: {before:.4f} -> {after:.4f} (steps kept per layer: {steps:.0f} "
                     "on average)")
    if report.layer_errors and len(labels := closed_form_labels(report.plan)) > 1:
        starts = Counter(labels[e.start] for e in report.layer_errors)
        lines.append("closed form each layer started from (the lowest error on the converted stream): "
                     + "; ".join(f"{label} in {n}" for label, n in starts.most_common()))
    return lines


def layer_error_records(report: ConvertReport) -> list[dict]:
    """Each layer's errors, with the closed form refinement started from by name."""
    labels = closed_form_labels(report.plan)
    return [{**e._asdict(), "start": labels[e.start]} for e in report.layer_errors]
