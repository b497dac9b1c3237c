"""``convert --to linear``: its settings, plan, operation layer by layer and report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from transformers import PretrainedConfig, PreTrainedModel

from attnsurg.arch.anatomy import AttentionAnatomy, linear_cache_values
from attnsurg.arch.families import LLAMA_LIKE_LAYERS
from attnsurg.errors import UserError
from attnsurg.methods import MethodSpec, register
from attnsurg.methods.base import CardText, Progress, StreamTarget, SurgeryInputs, SurgeryMethod, SurgeryReport, register_method
from attnsurg.methods.factorized import assemble_factorized
from attnsurg.methods.linear.operator import LinearOperator
from attnsurg.methods.linear.retrieval import copying_scores, most_copying
from attnsurg.methods.linear.stream import linear_streamed
from attnsurg.methods.linear.transfer import HybridShape, Transfer, TransferError
from attnsurg.methods.layerwise import operate_loaded
from attnsurg.methods.linear.settings import (  # noqa: F401  (the settings, with the method)
    LINEAR_CALIBRATION, LINEAR_CALIBRATION_TOKENS, NAME, SINKS, TRANSFER_STEPS, LinearSettings,
)
from attnsurg.requests import Calibration

HELD_OUT_SHARE = 1 / 8  # calibration windows held out of the fit (the last ones: one of each domain at 48)
STATE_CONTEXT = 8192  # the context the card compares the state with the original cache at


def unsupported_reason(anatomy: AttentionAnatomy) -> str | None:
    if anatomy.sliding_window is not None and anatomy.sliding_layers:
        return "its layers already attend over a sliding window"
    if anatomy.model_type not in LLAMA_LIKE_LAYERS:
        return (f"convert --to linear takes the {', '.join(LLAMA_LIKE_LAYERS)} families, and this model is "
                f"{anatomy.model_type}")
    return None


register(MethodSpec(NAME, "hybrid sliding-window + linear attention: a cache of fixed size (LoLCATs)",
                    unsupported_reason, full_budget="exact with a window as long as the context"))


@dataclass
class LinearPlan:
    window: int
    feature_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sinks: int = 0
    feature_map: str = "hedgehog"
    decay: bool = False
    features_before_rope: bool = False
    full_layers: tuple[int, ...] = ()  # layers left as the source's softmax attention over the whole context
    retrieval_layers: int = 0  # as many, chosen by measurement once the run starts (``full_layers`` then)

    @property
    def full_count(self) -> int:
        return len(self.full_layers) or self.retrieval_layers

    @property
    def hybrid_layers(self) -> int:
        return self.num_layers - self.full_count

    @property
    def shape(self) -> HybridShape:
        return HybridShape(self.window, self.feature_dim, self.sinks, self.feature_map, self.decay,
                           self.features_before_rope)

    def surgery(self) -> dict:
        linear = {"window": self.window, "feature_dim": self.feature_dim, "sinks": self.sinks,
                  "feature_map": self.feature_map, "decay": self.decay, "features_before_rope": self.features_before_rope}
        if self.full_layers:
            linear["full_layers"] = list(self.full_layers)
        return {"format": 1, "method": NAME, "linear": linear}

    def cache_values(self, context: int) -> int:
        """Cached values at ``context`` tokens, all layers: the hybrid layers' fixed-size caches and the full
        layers' growing ones."""
        return self.hybrid_layers * self.state_values(context) + self.full_count * self.original_values(context)

    def cache_ratio(self, context: int) -> float:
        """The cache at ``context`` tokens against the original's, all layers."""
        return self.cache_values(context) / (self.num_layers * self.original_values(context))

    def full_text(self) -> str:
        """What the plan keeps of softmax attention over the whole context, or nothing."""
        if self.full_layers:
            return f"; layers {','.join(map(str, self.full_layers))} keep softmax attention over the whole context"
        if self.retrieval_layers:
            return (f"; the {self.retrieval_layers} layers that copy most from far back (measured) keep softmax "
                    "attention over the whole context")
        return ""

    def state_values(self, context: int) -> int:
        """Cached values per layer at ``context`` tokens: the window's and the sinks' keys and values, the
        state S, z and its shift."""
        return linear_cache_values(self.num_kv_heads, self.head_dim, self.window, self.feature_dim, context,
                                   self.sinks)

    def original_values(self, context: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * context

    def added_parameters(self) -> int:
        """Feature maps, the linear part's weight and its decay, per layer."""
        return ((self.num_heads + self.num_kv_heads) * self.feature_dim * (self.head_dim + 1) + self.num_heads
                + self.num_kv_heads * self.decay)


def plan_linear(anatomy: AttentionAnatomy, settings: LinearSettings) -> LinearPlan:
    if reason := unsupported_reason(anatomy):
        raise UserError(f"cannot convert this model to linear attention: {reason}")
    if outside := [i for i in settings.full_layers if not 0 <= i < anatomy.num_layers]:
        raise UserError(f"--full-layers {','.join(map(str, outside))}: the model has layers 0-{anatomy.num_layers - 1}")
    if settings.retrieval_layers > anatomy.num_layers:
        raise UserError(f"--retrieval-layers {settings.retrieval_layers}: the model has {anatomy.num_layers} layers")
    return LinearPlan(settings.window, settings.feature_dim or anatomy.head_dim, anatomy.num_layers,
                      anatomy.num_heads, anatomy.num_kv_heads, anatomy.head_dim, settings.sinks, settings.feature_map,
                      settings.decays, settings.reads_before_rope, tuple(sorted(set(settings.full_layers))),
                      settings.retrieval_layers)


@dataclass
class LinearReport(SurgeryReport):
    """Besides every surgery's figures, each layer's attention-transfer error."""

    plan: LinearPlan
    layer_errors: list[TransferError] = field(default_factory=list)
    copying: list[float] = field(default_factory=list)  # each layer's long-range copying, where measured

    def mean_errors(self) -> dict[str, float | None]:
        def mean(values: list) -> float | None:
            values = [v for v in values if v is not None]
            return sum(values) / len(values) if values else None

        return {key: mean([getattr(e, key) for e in self.layer_errors])
                for key in ("before", "after", "held_before", "held_after", "steps")}


def held_out_windows(count: int) -> int:
    return min(count - 1, math.ceil(count * HELD_OUT_SHARE)) if count > 1 else 0


def feature_map_text(plan: LinearPlan) -> str:
    qualifiers = ((", decaying with distance" if plan.decay else "")
                  + (", read before RoPE" if plan.features_before_rope else ""))
    if plan.feature_map == "performer":
        return f"Performer random features (FAVOR+, orthogonal) of 2 x {plan.feature_dim}{qualifiers}"
    return f"Hedgehog feature maps of 2 x {plan.feature_dim}{qualifiers}"


def copying_line(report: LinearReport) -> str:
    """Which layers measurement kept as softmax attention, their long-range copying and the best one converted."""
    kept = report.plan.full_layers
    scores = ", ".join(f"{index}: {report.copying[index]:.2f}" for index in kept)
    converted = [score for index, score in enumerate(report.copying) if index not in kept]
    after = f"; the most of the converted layers: {max(converted):.2f}" if converted else ""
    return f"softmax attention kept in the layers that copy most from far back ({scores}){after}"


def cache_figure(plan: LinearPlan) -> dict[str, str]:
    """The card's cache row: per layer where every layer is hybrid, else over all layers."""
    if not plan.full_count:
        return {"metric": f"cached values per layer at {STATE_CONTEXT} tokens",
                "before": f"{plan.original_values(STATE_CONTEXT):,}",
                "after": f"{plan.state_values(STATE_CONTEXT):,} (x{plan.cache_ratio(STATE_CONTEXT):.3f})"}
    return {"metric": f"cached values at {STATE_CONTEXT} tokens, all layers",
            "before": f"{plan.num_layers * plan.original_values(STATE_CONTEXT):,}",
            "after": f"{plan.cache_values(STATE_CONTEXT):,} (x{plan.cache_ratio(STATE_CONTEXT):.3f})"}


class Linear(SurgeryMethod):
    names = (NAME,)
    settings = LinearSettings
    plan_type = LinearPlan
    step = "convert"
    report_type = LinearReport
    timed_step = "attention transfer"
    seconds_key = "convert_seconds"
    calibration = LINEAR_CALIBRATION

    def name_of(self, settings: LinearSettings) -> str:
        return settings.to

    def check_calibration(self, settings: LinearSettings, calibration: Calibration) -> None:
        """The feature maps learn from the keys older than the exact part (window and sinks): a calibration
        window no longer than that part has none, and training would leave the maps as they started."""
        exact = settings.window + settings.sinks
        if settings.steps and exact >= calibration.seq_len:
            raise UserError(f"--window {settings.window} (with {settings.sinks} sinks) covers every calibration window "
                            f"of {calibration.seq_len} tokens, so the feature maps would learn nothing; raise "
                            f"--calib-seq-len above {exact} (e.g. {2 * exact}) or lower --window")

    def step_label(self, settings: LinearSettings) -> str:
        return f"convert to linear (window {settings.window})"

    def progress_label(self, settings: LinearSettings) -> str:
        return "Attention transfer"

    def plan(self, anatomy: AttentionAnatomy, settings: LinearSettings) -> LinearPlan:
        return plan_linear(anatomy, settings)

    def transfer_of(self, settings: LinearSettings) -> Transfer:
        return Transfer(settings.steps, settings.transfer_lr)

    def operate_model(self, source: PreTrainedModel, inputs: SurgeryInputs, settings: LinearSettings,
                      report: LinearReport, progress: Progress = None) -> PreTrainedModel:
        self.choose_full_layers(settings, report, copying_scores(None, source.config, inputs.family, inputs.windows,
                                                                 settings.window, inputs.device, inputs.seed, source)
                                if settings.retrieval_layers else None)
        operator = LinearOperator(report.plan, inputs.family, source.config, self.transfer_of(settings),
                                  held_out_windows(len(inputs.windows)), source.dtype,
                                  inputs.device or torch.device("cpu"), inputs.seed)
        layers = operate_loaded(source, inputs.family, inputs.windows, operator, progress, inputs.device)
        report.layer_errors = [record for layer in layers for record in layer.records]
        added = {name: tensor for layer in layers for name, tensor in layer.added.items()}
        return assemble_factorized(source, report.plan.surgery(), {}, added=added)

    def operate_streamed(self, reader, source_config: PretrainedConfig, inputs: SurgeryInputs, settings: LinearSettings,
                         report: LinearReport, target: StreamTarget, progress: Progress = None) -> PretrainedConfig:
        self.choose_full_layers(settings, report, copying_scores(reader, source_config, inputs.family, inputs.windows,
                                                                 settings.window, inputs.device, inputs.seed)
                                if settings.retrieval_layers else None)
        written, report.layer_errors = linear_streamed(
            reader, source_config, inputs.family, inputs.windows, report.plan, self.transfer_of(settings),
            held_out_windows(len(inputs.windows)), target.directory, target.dtype, target.max_shard_size, progress,
            inputs.device, target.checkpoints, inputs.seed)
        return written

    def choose_full_layers(self, settings: LinearSettings, report: LinearReport, copying: list[float] | None) -> None:
        """With ``--retrieval-layers N``, the N layers that copy most from far back keep softmax attention."""
        if copying is not None:
            report.copying = copying
            report.plan = replace(report.plan, full_layers=most_copying(copying, settings.retrieval_layers))

    def card_text(self, settings: LinearSettings, report: LinearReport, calibration: Calibration,
                  healing: str) -> CardText:
        plan = report.plan
        errors = report.mean_errors()
        details = [
            f"exact softmax attention over the last {plan.window} keys and the first {plan.sinks} (attention "
            f"sinks); {feature_map_text(plan)} per head for every other older key{plan.full_text()}",
            f"attention transfer: {settings.steps} Adam steps per layer at {settings.transfer_lr:g}, one "
            f"calibration window each, early-stopped on {held_out_windows(calibration.tokens // calibration.seq_len)} "
            f"held-out windows; calibration: {calibration.tokens} tokens of the calibration part of "
            f"{calibration.data.described()}, windows of {calibration.seq_len}; {healing}",
        ]
        if errors["held_after"] is not None:
            details.append(f"mean held-out layer error against softmax attention: {errors['held_before']:.4f} -> "
                           f"{errors['held_after']:.4f}")
        return CardText(
            title=f"with hybrid sliding-window + linear attention (window {plan.window})",
            summary=("Every layer attends exactly over its last keys and through learned feature maps over all older "
                     "ones, whose keys and values are folded into a fixed-size state: the cache no longer grows with "
                     "the context (LoLCATs, Zhang et al. 2024). The source's projections are unchanged."),
            tags=["linear-attention", "lolcats", plan.feature_map],
            details=details,
            figures=[cache_figure(plan)],
        )

    def report_record(self, report: LinearReport) -> dict:
        plan = report.plan
        return {"plan": {"window": plan.window, "feature_dim": plan.feature_dim, "sinks": plan.sinks,
                         "feature_map": plan.feature_map, "decay": plan.decay,
                         "features_before_rope": plan.features_before_rope,
                         "full_layers": list(plan.full_layers), "copying": report.copying,
                         "state_values_per_layer": plan.state_values(STATE_CONTEXT),
                         "original_values_per_layer": plan.original_values(STATE_CONTEXT),
                         "cache_values": plan.cache_values(STATE_CONTEXT),
                         "context": STATE_CONTEXT, "added_parameters_per_layer": plan.added_parameters()},
                "layer_errors": [e._asdict() for e in report.layer_errors]}

    def report_text(self, model: str, report: LinearReport, dry_run: bool) -> list:
        plan = report.plan
        return [f"linear plan for {model}: softmax over the last {plan.window} keys and the first {plan.sinks}, "
                f"{feature_map_text(plan)} per head beyond{plan.full_text()}; cache at {STATE_CONTEXT} tokens "
                f"x{plan.cache_ratio(STATE_CONTEXT):.3f} of the original's ({plan.state_values(STATE_CONTEXT):,} values "
                f"per hybrid layer), {plan.added_parameters():,} parameters added per hybrid layer"]

    def result_text(self, report: LinearReport) -> list:
        lines = [copying_line(report)] if report.copying else []
        errors = report.mean_errors()
        if errors["before"] is None:
            return lines
        line = f"mean relative layer error against softmax attention: {errors['before']:.4f} -> {errors['after']:.4f}"
        if errors["held_after"] is not None:
            line += (f"; held out {errors['held_before']:.4f} -> {errors['held_after']:.4f} (steps kept per layer: "
                     f"{errors['steps']:.0f} on average)")
        return [*lines, line]

    def extra_files(self) -> dict[str, str]:
        from attnsurg.modeling import MODELING_FILE

        return {MODELING_FILE.name: MODELING_FILE.read_text(encoding="utf-8")}


register_method(Linear())
