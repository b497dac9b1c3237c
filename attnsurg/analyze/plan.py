"""``attnsurg analyze plan``: per method, the smallest budget predicted to keep the perplexity ratio within a
target, written as a recipe.

Per method, a per-layer error proxy is measured on the model at every candidate budget without converting it.
Each method owns its proxy and its budget knob (a ``methods.planning.PlannedMethod`` its module registers):
low-rank truncation energy (svd, asvd, svdllm, and their ``-allocate`` forms), the attention mass outside
the top-k (loki) or outside the keys rank-r scores pick (loki-variance), the closed form's layer error (mla),
the fitted error of each whitened projection tensor (tucker, cp).

A budget's proxy is the sum over layers. The error model maps it to a perplexity ratio,
``log(ratio) = a * proxy^p``, with ``a`` and ``p`` fitted to two real conversions of the model (the anchors,
made the way the method's command makes them and scored on the same windows as the source). A ratio is the
worst over the scored texts: the calibration text's eval part and the ``eval_domains`` (by default wiki, c4
and code), so the plan holds off the calibration domain too. The plan is the smallest candidate budget whose
predicted ratio stays within the target; with ``verify`` it is converted too and the measured ratios stand
beside the prediction.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel
from transformers import PreTrainedModel, set_seed

from attnsurg import ui
from attnsurg.analyze.report import PlanReport, MethodPlanReport, Anchor, write_json
from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import attention_layers, input_statistics
from attnsurg.errors import UserError
from attnsurg.eval.perplexity import perplexity_of, scoring_windows
from attnsurg.info import inspect_model
from attnsurg.io.assets import ensure_text
from attnsurg.io.load import resolve_device
from attnsurg.io.recipe_file import dump_recipe
from attnsurg.io.save import staged_checkpoint
from attnsurg.methods import registered_methods
from attnsurg.methods.base import SurgeryInputs, method_for
from attnsurg.methods.planning import PlanContext, PlannedMethod, ScoredText, planned_methods
from attnsurg.pipelines.source import check_calibration, load_source, source_windows
from attnsurg.placement import on_device
from attnsurg.recipe import Evaluation, Recipe, surgery_step
from attnsurg.requests import EVAL_DOMAINS, PlanRequest, TextData


def parse_methods(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    planned = planned_methods()
    unknown = [name for name in names if name not in planned]
    if unknown or not names:
        raise UserError(f"--methods '{value}': plan any of {', '.join(planned)}")
    return names


# ------------------------------------------------------------------------------------------ error model
MAX_LOG_RATIO = 50.0  # predictions are capped at e^50 (anchors near x1 can give the fitted power any size)


@dataclass(frozen=True)
class ErrorModel:
    """log(ratio) = log(floor) + scale * proxy^power, through two anchors (proxy, measured ratio); the floor is
    the ratio at proxy 0 (x1 for a method exact there)."""

    scale: float
    power: float
    floor: float = 1.0

    @classmethod
    def through(cls, first: tuple[float, float], second: tuple[float, float], floor: float = 1.0) -> ErrorModel:
        (x1, r1), (x2, r2) = first, second
        y1, y2 = (math.log(max(r / floor, 1 + 1e-9)) for r in (r1, r2))
        proportional = cls(scale=(y1 + y2) / max(x1 + x2, 1e-12), power=1.0, floor=floor)
        if min(x1, x2) <= 0 or abs(math.log(x2 / x1)) < 1e-9:  # one point's worth
            return proportional
        power = math.log(y2 / y1) / math.log(x2 / x1)
        if power <= 0:  # the larger proxy measured no worse: the proxy does not order these two; stay proportional
            return proportional
        return cls(scale=y1 / x1 ** power, power=power, floor=floor)

    def ratio(self, proxy: float) -> float:
        """The predicted ratio, at most e^MAX_LOG_RATIO: far past any target, and finite in JSON."""
        try:
            exponent = math.log(self.floor) + self.scale * max(proxy, 0.0) ** self.power
        except OverflowError:
            exponent = MAX_LOG_RATIO
        return math.exp(min(exponent, MAX_LOG_RATIO))


def smallest_within(budgets: tuple[float, ...], predicted: list[float], target: float) -> float | None:
    """The smallest budget whose prediction, and every larger budget's, stays within the target."""
    chosen = None
    for budget, ratio in sorted(zip(budgets, predicted, strict=True), reverse=True):
        if ratio > target:
            break
        chosen = budget
    return chosen


# ------------------------------------------------------------------------------------------ conversions
def recipe_at(ctx: PlanContext, settings: BaseModel, output: Path, eval_domains: list[str] | None = None) -> Recipe:
    """The method's recipe at a budget, calibrated and scored as the plan is (no other domains unless given)."""
    return Recipe(model=ctx.request.model, output=output, steps=[surgery_step(settings)], calibration=ctx.request.calibration,
                  eval=Evaluation(tokens=ctx.request.eval_tokens, domains=eval_domains or []), seed=ctx.request.seed)


def operated(ctx: PlanContext, settings: BaseModel) -> PreTrainedModel:
    """The method applied to the loaded source exactly as its command applies it, in memory."""
    method = method_for(settings)
    set_seed(ctx.request.seed)
    report = method.report_type(method.plan(ctx.anatomy, settings), ctx.anatomy)
    inputs = SurgeryInputs(ctx.family, ctx.windows, ctx.request.calibration, ctx.device, ctx.request.seed)
    return method.operate_model(ctx.model, inputs, settings, report)


def measured_ratios(ctx: PlanContext, method: PlannedMethod, budget: float) -> dict[str, float]:
    """The method at ``budget``, converted in memory and scored on every text: its perplexity ratio on each."""
    model = operated(ctx, method.settings(budget, ctx.anatomy))
    return {text.name: perplexity_of(model, *text.windows, f"{method.name} at {budget:g} on {text.name}", ctx.device)
            / text.ppl_source for text in ctx.scored}


def worst(ratios: dict[str, float]) -> float:
    return max(ratios.values())


def plan_method(ctx: PlanContext, method: PlannedMethod) -> tuple[MethodPlanReport, str | None]:
    """Proxies, anchors, the fitted error model, the chosen budget (and its recipe text).

    The error model is first fitted to the method's two default anchors. When the budget it chooses is not one
    of them, that budget is converted too (its ``predicted`` ratio kept beside the measured one) and the model is
    refitted through it and the default anchor across the target from it, so the final choice rests on the two
    conversions nearest the decision."""
    with ui.status(f"Measuring the {method.name} error proxy at {len(method.budgets)} budgets..."):
        per_layer = method.proxy(ctx, method.budgets)
    proxies = [sum(layers) for layers in per_layer]
    anchors = [measured_anchor(ctx, method, budget, proxies[method.budgets.index(budget)]) for budget in method.anchors]
    floor = None if method.floor_budget is None else measured_anchor(ctx, method, method.floor_budget, 0.0)
    fitted = anchors
    model, predicted, chosen = fitted_choice(ctx, proxies, method.budgets, fitted, floor)
    if chosen is not None and chosen not in method.anchors:
        nearer = measured_anchor(ctx, method, chosen, proxies[method.budgets.index(chosen)])
        nearer.predicted = predicted[method.budgets.index(chosen)]
        fitted = [nearer, partner(anchors, nearer, ctx.request.target_ratio)]
        anchors = anchors + [nearer]
        model, predicted, chosen = fitted_choice(ctx, proxies, method.budgets, fitted, floor)
    for anchor in anchors:
        anchor.fitted = anchor in fitted
    report = MethodPlanReport(method=method.name, budgets=list(method.budgets), proxies=proxies,
                              layer_proxies=per_layer, predicted=predicted, anchors=anchors, floor=floor,
                              scale=model.scale, power=model.power, chosen=chosen)
    if chosen is None:
        return report, None
    report.predicted_ratio = predicted[method.budgets.index(chosen)]
    if ctx.request.verify:
        at_anchor = next((a for a in anchors if a.budget == chosen), None)
        report.chosen_is_anchor = at_anchor is not None
        report.measured_ratios = at_anchor.ratios if at_anchor else measured_ratios(ctx, method, chosen)
        report.measured_ratio = worst(report.measured_ratios)
        report.relative_difference = report.measured_ratio / report.predicted_ratio - 1
    return report, recipe_text(ctx, method, chosen, report)


def measured_anchor(ctx: PlanContext, method: PlannedMethod, budget: float, proxy: float) -> Anchor:
    ratios = measured_ratios(ctx, method, budget)
    return Anchor(budget=budget, proxy=proxy, ratio=worst(ratios), ratios=ratios)


def fitted_choice(ctx: PlanContext, proxies: list[float], budgets: tuple[float, ...], anchors: list[Anchor],
                  floor: Anchor | None) -> tuple[ErrorModel, list[float], float | None]:
    """The error model through two anchors, its prediction at every budget, and the budget it chooses."""
    model = ErrorModel.through(*[(a.proxy, a.ratio) for a in anchors], floor=floor.ratio if floor else 1.0)
    predicted = [model.ratio(p) for p in proxies]
    return model, predicted, smallest_within(budgets, predicted, ctx.request.target_ratio)


def partner(defaults: list[Anchor], nearer: Anchor, target: float) -> Anchor:
    """Of the default anchors, the one measured across the target from ``nearer`` (so the refit interpolates);
    when both or neither are, the one nearest it in budget."""
    across = [a for a in defaults if (a.ratio > target) != (nearer.ratio > target)]
    pool = across if len(across) == 1 else defaults
    return min(pool, key=lambda a: abs(a.budget - nearer.budget))


def method_summary(report: MethodPlanReport) -> str:
    if report.chosen is None:
        return f"{report.method}: no budget predicted within the target"
    line = f"{report.method}: budget {report.chosen:g}, predicted x{report.predicted_ratio:.3f}"
    if report.measured_ratio is not None:
        line += f", measured x{report.measured_ratio:.3f}" + (" (an anchor)" if report.chosen_is_anchor
                                                              else f" ({report.relative_difference:+.1%})")
    return line


def recipe_text(ctx: PlanContext, method: PlannedMethod, budget: float, report: MethodPlanReport) -> str:
    name = Path(ctx.request.model.ref).name or ctx.request.model.ref
    output = Path("out") / f"{name}-{method.name}-{budget:g}"
    recipe = recipe_at(ctx, method.settings(budget, ctx.anatomy), output, list(EVAL_DOMAINS))
    recipe = recipe.model_copy(update={"description": f"{method.name} at budget {budget:g}, planned for a perplexity "
                                                      f"ratio within x{ctx.request.target_ratio:g}"})
    anchors = ", ".join(f"x{a.ratio:.3f} at {a.budget:g}" for a in report.anchors)
    texts = ", ".join(text.name for text in ctx.scored)
    header = (f"# attnsurg analyze plan --target-ratio {ctx.request.target_ratio:g}: predicted x{report.predicted_ratio:.3f} "
              f"at worst over {ctx.request.eval_tokens} tokens of the eval parts of {texts}\n"
              f"# (error model fitted to real conversions: {anchors})\n")
    return header + dump_recipe(recipe)


# ------------------------------------------------------------------------------------------ the command
def plan_reads(request: PlanRequest) -> list[Path]:
    """What a plan reads, which its output must never replace (``io.guard``)."""
    source = inspect_model(request.model)[0]
    text = request.calibration.data.text
    return ([source.files] if source.is_local else []) + ([Path(text)] if text is not None else [])


def load_context(request: PlanRequest) -> PlanContext:
    source, _, anatomy = inspect_model(request.model)
    family = family_for_surgery(anatomy.model_type)
    for name in request.methods:
        if reason := registered_methods()[name.split("-")[0]].unsupported_reason(anatomy):
            raise UserError(f"--methods: cannot plan {name} for this model: {reason}")
    device = resolve_device(request.device)
    check_calibration(request.calibration, anatomy)
    for domain in request.eval_domains:  # fetched before minutes of work, not after
        ensure_text(domain)
    model, tokenizer = load_source(request.model, source)
    windows = source_windows(tokenizer, request.calibration, anatomy)
    attentions = attention_layers(model, family)
    with on_device(model, device):
        stats = input_statistics(model, attentions + [a.o_proj for a in attentions], windows)
    stats = list(zip(stats[: len(attentions)], stats[len(attentions):], strict=True))
    return PlanContext(request, model, tokenizer, anatomy, family, device, windows, stats,
                       scored_texts(request, model, tokenizer, anatomy, device))


def scored_texts(request: PlanRequest, model: PreTrainedModel, tokenizer, anatomy: AttentionAnatomy,
                 device: torch.device) -> list[ScoredText]:
    """The calibration text's eval part, then each eval domain it is not, with the source's perplexity on each."""
    data = request.calibration.data.scored()
    first = data.dataset or Path(data.text).name
    texts = [(first, data)] + [(domain, TextData(dataset=domain)) for domain in request.eval_domains if domain != first]
    texts = [(name, scoring_windows(tokenizer, text, request.eval_tokens, anatomy.max_positions)) for name, text in texts]
    return [ScoredText(name, windows, perplexity_of(model, *windows, f"the source on {name}", device))
            for name, windows in texts]


def run_plan(request: PlanRequest) -> tuple[PlanReport, list[Path]]:
    """Plan every requested method and write plan.json (with its schema), plan.png and one recipe per method
    that has a budget within the target into ``request.output``."""
    from attnsurg.analyze.plots import plan_figure

    started = time.perf_counter()
    planned = planned_methods()
    for name in request.methods:
        if name not in planned:
            raise UserError(f"--methods: '{name}' is not planned; plan any of {', '.join(planned)}")
    with staged_checkpoint(request.output, request.overwrite, plan_reads(request)) as staging:
        ctx = load_context(request)
        methods, recipes = [], {}
        for name in request.methods:
            report, text = plan_method(ctx, planned[name])
            ui.info(method_summary(report))  # each method's result as it comes: a plan can take an hour
            methods.append(report)
            if text is not None:
                recipes[f"{name}.yaml"] = text
        report = PlanReport(model=request.model.ref, text=request.calibration.data.dataset or str(request.calibration.data.text),
                            eval_tokens=request.eval_tokens, target_ratio=request.target_ratio,
                            ppl_source={text.name: text.ppl_source for text in ctx.scored}, methods=methods)
        for file, text in recipes.items():
            (staging / file).write_text(text, encoding="utf-8")
        plot = plan_figure(report, staging / "plan.png")
        report.seconds = time.perf_counter() - started
        files = write_json(report, staging, "plan") + [plot] + [staging / f for f in recipes]
    return report, [request.output / f.name for f in files]
