"""Tensor-decomposed multi-head projections: ``compress --method tucker|cp``.

Each targeted projection's per-head weights form a tensor T of shape heads x head_dim x hidden (q/k/v:
T[h] = W_h, the d x D block of head h; o: T[h] = W_o[:, h]^T). The decomposition (Tucker: tucker.py, CP:
cp.py) runs on the *whitened* tensor, so it fits what the layer computes on calibration data rather than
the raw weights (as svdllm does for matrices):

- q/k/v: the error of head h's output is ||(W_h - W'_h) S||_F with S S^T = E[x x^T], so T'[h] = T[h] S
  (exact), and the hidden factor is mapped back with S^-T;
- o: the input is the concatenated head outputs; a shared d x d whitening S_d (Cholesky of the mean per-head
  covariance) and a per-head scale s_h keep the factors shared across heads, T'[h] = s_h S_d^T T[h]
  (cross-head correlations are ignored);
- consumer weights (default; as in lowrank.py: rotation-averaged key/query moments, W_o^T W_o) weight the
  q/k/v head outputs in the same shared form, T'[h] = s_h L^T T[h] S.

Mapping the factors back leaves every shared factor shared, so the module stores one tensor per mode.
Where k and v are both decomposed and their hidden ranks together are below 2 G d, the layer caches those
hidden-mode coordinates instead of K and V (exactly the same outputs; the KV cache shrinks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator
from transformers import PreTrainedModel

from attnsurg import ui
from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import Family
from attnsurg.errors import UserError
from attnsurg.methods import MethodSpec, cp, register, tucker
from attnsurg.methods.base import CardText, CompressMethod, LayerTensors, register_method
from attnsurg.methods.factorized import factorized_card_text, factorized_record, factorized_text
from attnsurg.methods.consumers import LayerContext, layer_contexts
from attnsurg.methods.head_whitening import Whitened, consumer_blocks, module_state, refit_hidden_factor, whiten
from attnsurg.methods.lowrank import PROJECTIONS, parse_targets, targets_of, unsupported_reason
from attnsurg.methods.planning import PlanContext, PlannedMethod, Proxy, register_planned
from attnsurg.methods.rank_allocation import ALLOCATION_FLOOR
from attnsurg.recipe import CompressSettings, ratio_unless_ranked

DECOMPOSERS = {"tucker": tucker, "cp": cp}
MAX_ITERATIONS = 50

for _module in DECOMPOSERS.values():
    register(MethodSpec(_module.NAME, _module.SUMMARY, unsupported_reason))


class HeadTensorSettings(CompressSettings):
    """``compress --method tucker|cp``. The budget is ``ratio`` or ``ranks``: Tucker's (heads, head_dim,
    hidden) mode ranks, or CP's single rank. ``stacked`` (Tucker only): q, k, v and o of a layer in one
    decomposition with factors shared across heads and projections; its ranks are (head_dim, hidden)."""

    method: Literal["tucker", "cp"] = "tucker"
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    ratio: float | None = Field(None, gt=0, le=1)
    ranks: tuple[int, ...] | None = None
    weighted: bool = True
    stacked: bool = False
    allocate: bool = False  # Tucker at a ratio: each layer's budget spread over its projections by their error

    @classmethod
    def accepts(cls, key: str) -> bool:
        return key == "rank" or super().accepts(key)  # CP's single rank (``--rank``)

    @field_validator("targets", mode="before")
    @classmethod
    def _projection_names(cls, value) -> tuple[str, ...]:
        return targets_of(value)

    @model_validator(mode="before")
    @classmethod
    def _default_budget(cls, data):
        return ratio_unless_ranked(data, ("ranks", "rank"))

    @field_validator("ranks", mode="before")
    @classmethod
    def _comma_list(cls, value):
        """``"9,48,160"`` (the command line's ``--ranks``) as a list of ranks."""
        if isinstance(value, str):
            try:
                return [int(part) for part in value.split(",")]
            except ValueError:
                raise ValueError(f"expects comma-separated integers such as 9,48,160, got '{value}'") from None
        return value

    @model_validator(mode="after")
    def _stacked_is_tucker(self):
        if self.stacked and self.method != "tucker":
            raise ValueError("stacked is a Tucker layout; use method: tucker")
        return self

    @model_validator(mode="after")
    def _allocate_is_tucker_at_a_ratio(self):
        if self.allocate and (self.method != "tucker" or self.stacked or self.ratio is None):
            raise ValueError("allocate spreads a Tucker --ratio over each layer's projections: use method: tucker "
                             "with a ratio, not stacked")
        return self

    @model_validator(mode="before")
    @classmethod
    def _cp_rank(cls, data):
        """``rank: R`` is how CP's single rank reads in a recipe (as ``--rank`` on the command line); Tucker has
        one rank per mode."""
        if not isinstance(data, dict) or "rank" not in data:
            return data
        if data.get("method") == "tucker":
            modes = "head_dim,hidden (e.g. --ranks 64,200)" if data.get("stacked") else "heads,head_dim,hidden (e.g. --ranks 9,48,160)"
            raise ValueError(f"tucker takes one rank per mode: --ranks {modes}")
        if data.get("method") == "cp" and "ranks" not in data:
            data = {key: value for key, value in data.items() if key != "rank"} | {"ranks": [data["rank"]]}
        return data


@dataclass(frozen=True)
class HeadUnit:
    """One projection of one layer, seen as a heads x head_dim x hidden tensor."""

    layer: int
    name: str  # q, k, v, o
    heads: int
    head_dim: int
    hidden: int

    @property
    def heads_on(self) -> str:
        return "input" if self.name == "o" else "output"

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.heads, self.head_dim, self.hidden

    @property
    def dense_params(self) -> int:
        return math.prod(self.shape)

    @property
    def label(self) -> str:
        return f"layer {self.layer} {PROJECTIONS[self.name]}"


@dataclass
class HeadTensorPlan:
    method: str  # tucker | cp
    targets: tuple[str, ...]
    units: list[HeadUnit]
    ranks: list[tuple[int, ...] | None]  # tucker: (heads, head_dim, hidden); cp: (R,); None: dense
    choose_ranks: bool  # tucker from --ratio: the split between modes is chosen per unit on calibration data
    budgets: list[int] = field(default_factory=list)  # parameters each unit may keep (ratio mode)
    kv_values_per_layer: int = 0
    weighted: bool = True  # consumer weights (shared across heads) on q/k/v outputs
    kv_latent = False
    allocate: bool = False  # Tucker at a --ratio: each layer's budget spread over its projections (``allocate_layer_budget``)

    def params(self, unit: HeadUnit, ranks: tuple[int, ...] | None) -> int:
        return unit.dense_params if ranks is None else DECOMPOSERS[self.method].parameters(unit.shape, ranks)

    def flops(self, unit: HeadUnit, ranks: tuple[int, ...] | None) -> int:
        return 2 * unit.dense_params if ranks is None else DECOMPOSERS[self.method].flops(unit.shape, ranks)

    def unit_params(self, index: int, after: bool) -> int:
        return self.params(self.units[index], self.ranks[index] if after else None)

    @property
    def columns(self) -> list[str]:
        """The rank columns of the card's table."""
        return list(self.targets)

    def params_before(self) -> int:
        return sum(u.dense_params for u in self.units)

    def params_after(self) -> int:
        return sum(self.params(u, r) for u, r in zip(self.units, self.ranks))

    def flops_before(self) -> int:
        return 2 * self.params_before()

    def flops_after(self) -> int:
        return sum(self.flops(u, r) for u, r in zip(self.units, self.ranks))

    @property
    def kept_fraction(self) -> float:
        return self.params_after() / self.params_before()

    def rank_label(self, index: int) -> str:
        ranks = self.ranks[index]
        if ranks is None:
            return "dense"
        return "auto" if self.choose_ranks and not ranks else "x".join(map(str, ranks))

    def hidden_rank(self, index: int) -> int | None:
        ranks = self.ranks[index]
        return None if not ranks else ranks[-1]

    def factored_kv(self) -> dict[int, tuple[int, int]]:
        """Layers whose k and v are both decomposed with hidden ranks that together undercut 2 G d: the cache
        holds those coordinates instead of K and V (same outputs, fewer values per token)."""
        by_layer: dict[int, dict[str, int | None]] = {}
        for i, unit in enumerate(self.units):
            if unit.name in ("k", "v"):
                by_layer.setdefault(unit.layer, {})[unit.name] = self.hidden_rank(i)
        return {
            layer: (r["k"], r["v"]) for layer, r in by_layer.items()
            if r.get("k") and r.get("v") and r["k"] + r["v"] < self.kv_values_per_layer
        }

    def kv_values_after(self) -> int:
        factored = self.factored_kv()
        layers = {u.layer for u in self.units}
        return sum(sum(factored[layer]) if layer in factored else self.kv_values_per_layer for layer in layers)

    def surgery(self, family: Family) -> dict:
        specs = {}
        for unit, ranks in zip(self.units, self.ranks):
            if ranks is None:
                continue
            path = f"{family.layers_path}.{unit.layer}.{family.attention_attr}.{PROJECTIONS[unit.name]}"
            spec = {"kind": self.method, "heads": unit.heads, "head_dim": unit.head_dim, "heads_on": unit.heads_on}
            spec.update({"ranks": list(ranks)} if self.method == "tucker" else {"rank": ranks[0]})
            specs[path] = spec
        factored = {str(layer): list(ranks) for layer, ranks in self.factored_kv().items()}
        return {"format": 1, "method": self.method, "head_tensor": specs, "factored_kv": factored}


def plan_units(anatomy: AttentionAnatomy, targets: tuple[str, ...]) -> list[HeadUnit]:
    D, H, G, d = anatomy.hidden_size, anatomy.num_heads, anatomy.num_kv_heads, anatomy.head_dim
    heads = {"q": H, "k": G, "v": G, "o": H}
    return [HeadUnit(layer, t, heads[t], d, D) for layer in range(anatomy.num_layers) for t in targets]


def plan_head_tensor(
    anatomy: AttentionAnatomy,
    method: str,
    targets: str | tuple[str, ...],
    ratio: float | None = None,
    ranks: tuple[int, ...] | None = None,
    weighted: bool = True,
    allocate: bool = False,
) -> HeadTensorPlan:
    """Validate a request and give each unit its ranks (Tucker from --ratio: chosen after calibration)."""
    if method not in DECOMPOSERS:
        raise UserError(f"unknown tensor method '{method}'; choose from {', '.join(DECOMPOSERS)}")
    reason = unsupported_reason(anatomy)
    if reason:
        raise UserError(f"cannot compress this model: {reason}")
    targets = parse_targets(targets)
    flag = "--ranks" if method == "tucker" else "--rank"
    if (ratio is None) == (ranks is None):
        raise UserError(f"give the budget as exactly one of --ratio or {flag}")
    units = plan_units(anatomy, targets)
    decomposer = DECOMPOSERS[method]
    plan = HeadTensorPlan(method, targets, units, [], choose_ranks=False, kv_values_per_layer=anatomy.kv_values_per_layer,
                          weighted=weighted)
    if ranks is not None:
        for unit in units:
            decomposer.check_ranks(unit.shape, tuple(ranks), unit.label)
        plan.ranks = [tuple(ranks)] * len(units)
        return plan
    if not 0 < ratio <= 1:
        raise UserError(f"--ratio must be in (0, 1], got {ratio}")
    plan.budgets = [int(ratio * u.dense_params) for u in units]
    plan.ranks = [decomposer.ranks_for_budget(u.shape, b) for u, b in zip(units, plan.budgets)]
    for unit, r in zip(units, plan.ranks):
        if r is not None and min(r) < 1:
            raise UserError(f"--ratio {ratio} leaves {unit.label} no rank at all; use a larger ratio")
    plan.choose_ranks = method == "tucker"
    plan.allocate = allocate and plan.choose_ranks
    return plan


# --- fitting ----------------------------------------------------------------------------------------------


def warn_unconverged(unconverged: list[tuple[str, float]], total: int, what: str, cap: str, tolerance: float) -> None:
    """One warning for the fits that stopped at their cap: how many, and the worst achieved error."""
    if unconverged:
        label, error = max(unconverged, key=lambda item: item[1])
        ui.warn(f"{len(unconverged)} of {total} {what} stopped at the cap of {cap} before tolerance {tolerance:g}; "
                f"kept their last factors (largest relative error {error:.4f}, {label})")


def whitened_unit(source: PreTrainedModel, family: Family, contexts: list[LayerContext], unit: HeadUnit, weighted: bool):
    """A unit's module path, its linear layer, input statistics, consumer blocks and whitened tensor."""
    prefix = f"{family.layers_path}.{unit.layer}.{family.attention_attr}"
    linear, unit_stats, consumer, w = whitened_projection(unit, source.get_submodule(prefix), contexts[unit.layer], weighted)
    return f"{prefix}.{PROJECTIONS[unit.name]}", linear, unit_stats, consumer, w


def whitened_projection(unit: HeadUnit, attention: torch.nn.Module, context: LayerContext, weighted: bool):
    """The unit's linear layer in ``attention``, its input statistics, consumer blocks and whitened tensor."""
    linear = attention.get_submodule(PROJECTIONS[unit.name])
    unit_stats = context.o if unit.name == "o" else context.x
    consumer = consumer_blocks(unit, context) if weighted else None
    return linear, unit_stats, consumer, whiten(unit, linear.weight, unit_stats, consumer)


def unit_ranks(plan: HeadTensorPlan, index: int, w: Whitened) -> tuple[int, ...] | None:
    """Unit ``index``'s ranks: as planned, or (Tucker at a --ratio) the mode ranks of its budget that fit its
    whitened tensor best; None when the budget holds the dense weight."""
    if plan.choose_ranks:
        plan.ranks[index] = DECOMPOSERS[plan.method].best_ranks_for_budget(w.tensor, plan.budgets[index])
    return plan.ranks[index]


@dataclass
class LayerFit:
    """One decoder layer's decomposed projections: name -> module tensors, and per unit its error."""

    replaced: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    errors: list[float] = field(default_factory=list)
    unconverged: list[tuple[str, float]] = field(default_factory=list)


@torch.no_grad()
def decompose_layer(plan: HeadTensorPlan, index: int, attention: torch.nn.Module, context: LayerContext,
                    seed: int = 0) -> LayerFit:
    """Decompose the plan's units of decoder layer ``index`` (``attention``: its attention module) on their
    whitened tensors; at a Tucker --ratio this chooses their ranks (``plan.ranks``)."""
    decomposer = DECOMPOSERS[plan.method]
    layer = LayerFit()
    units = [(i, unit, *whitened_projection(unit, attention, context, plan.weighted))
             for i, unit in enumerate(plan.units) if unit.layer == index]
    if plan.allocate:
        allocate_layer_budget(plan, [i for i, *_ in units], [w for *_, w in units])
    for i, unit, linear, unit_stats, consumer, w in units:
        ranks = unit_ranks(plan, i, w)
        if ranks is None:
            layer.errors.append(0.0)
            continue
        fit = decomposer.decompose(w.tensor, ranks, MAX_ITERATIONS, decomposer.TOLERANCE, seed)
        layer.errors.append(fit.relative_error)
        if not fit.converged:
            layer.unconverged.append((unit.label, fit.relative_error))
        state = module_state(plan, fit.factors, w, linear.bias)
        refit_hidden_factor(unit, state, linear.weight, unit_stats, consumer)
        layer.replaced[PROJECTIONS[unit.name]] = state
    return layer


ALLOCATION_STEP = 0.05  # Tucker --allocate moves budget in steps of this share of a projection's dense parameters


def allocate_layer_budget(plan: HeadTensorPlan, indices: list[int], whitened: list[Whitened]) -> None:
    """Tucker ``--allocate``: one layer's budget (the sum of its projections') spread over them by their own
    error. Each keeps ALLOCATION_FLOOR of its uniform budget; the rest goes, a step of ALLOCATION_STEP of a
    projection's dense size at a time, to the projection whose relative truncated-HOSVD error falls most per
    parameter (on Gemma 3 270M at 0.5, q and k lose 2-9% and v and o 13-53% at uniform budgets)."""
    splits = [tucker.BudgetSplits(w.tensor) for w in whitened]
    dense = [plan.units[i].dense_params for i in indices]
    budgets = [int(ALLOCATION_FLOOR * plan.budgets[i]) for i in indices]
    remaining = sum(plan.budgets[i] for i in indices) - sum(budgets)
    errors = [split.best(budget)[1] for split, budget in zip(splits, budgets)]

    def step_gain(j: int) -> tuple[float, int, float]:
        step = min(max(1, int(ALLOCATION_STEP * dense[j])), dense[j] - budgets[j])
        after = splits[j].best(budgets[j] + step)[1] if step > 0 else errors[j]
        return (errors[j] - after) / max(step, 1), step, after

    gains = [step_gain(j) for j in range(len(indices))]
    while True:
        open_steps = [j for j, (gain, step, _) in enumerate(gains) if 0 < step <= remaining and gain > 0]
        if not open_steps:
            break
        j = max(open_steps, key=lambda k: gains[k][0])
        _, step, errors[j] = gains[j]
        budgets[j] += step
        remaining -= step
        gains[j] = step_gain(j)
    for i, budget in zip(indices, budgets):
        plan.budgets[i] = budget


RANK_NOTES = {
    "tucker": "Tucker ranks are heads x head_dim x hidden; the hidden factor is computed once per token for all heads.",
    "cp": "CP rank R: one shared hidden -> R projection per token, a mixing vector per head, one R -> head_dim map.",
}


def budget_line(settings, plan, detail: str) -> str:
    """The card's budget line of a tensor method (``detail``: how the ranks were split)."""
    budget = f"ratio {settings.ratio}" if settings.ratio is not None else f"ranks {','.join(map(str, settings.ranks))}"
    return f"budget: {budget} (fraction of the targeted parameters kept; achieved {plan.kept_fraction:.3f}){detail}"


class HeadTensor(CompressMethod):
    """``compress --method tucker|cp`` (each projection's heads as one tensor)."""

    names = ("tucker", "cp")
    settings = HeadTensorSettings
    plan_type = HeadTensorPlan
    timed_step = "factorization"

    def handles(self, settings) -> bool:
        return super().handles(settings) and not settings.stacked

    def plan(self, anatomy: AttentionAnatomy, settings) -> HeadTensorPlan:
        return plan_head_tensor(anatomy, settings.method, settings.targets, settings.ratio, settings.ranks, settings.weighted,
                                settings.allocate)

    def operate_layer(self, plan: HeadTensorPlan, family: Family, index: int, context: LayerContext, seed: int) -> LayerTensors:
        attention = f"{family.layers_path}.{index}.{family.attention_attr}"
        fit = decompose_layer(plan, index, context.attn, context, seed)
        ranks = [list(plan.ranks[i]) if plan.ranks[i] else None for i, u in enumerate(plan.units) if u.layer == index]
        return LayerTensors({f"{attention}.{name}": state for name, state in fit.replaced.items()}, {},
                            [[error, r] for error, r in zip(fit.errors, ranks, strict=True)], fit.unconverged)

    def shapes_known_late(self, plan: HeadTensorPlan) -> bool:
        return plan.choose_ranks

    def apply_records(self, plan: HeadTensorPlan, records: list) -> list[float]:
        plan.ranks = [tuple(ranks) if ranks else None for _, ranks in records]
        return [error for error, _ in records]

    def warn_capped(self, plan: HeadTensorPlan, unconverged: list[tuple[str, float]], total: int) -> None:
        warn_unconverged(unconverged, total, f"{plan.method} decompositions", f"{MAX_ITERATIONS} iterations",
                         DECOMPOSERS[plan.method].TOLERANCE)

    def plan_record(self, plan, anatomy: AttentionAnatomy) -> dict:
        return factorized_record(plan, anatomy)

    def plan_text(self, model: str, plan, anatomy: AttentionAnatomy, dry_run: bool) -> list:
        return factorized_text(model, plan, anatomy, dry_run)

    def plan_card_text(self, settings, plan: HeadTensorPlan, anatomy: AttentionAnatomy) -> CardText:
        split = "; Tucker mode ranks chosen per projection by HOSVD error" if plan.choose_ranks else ""
        split += "; each layer's budget spread over its projections by that error (--allocate)" if plan.allocate else ""
        return factorized_card_text(plan, anatomy, "tensor-decomposed", budget_line(settings, plan, split),
                                    fit_note="; fitted to the whitened calibration inputs", rank_note=RANK_NOTES[plan.method])


register_method(HeadTensor())


# ------------------------------------------------------------------------------------- analyze plan
PARAMETER_BUDGETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # the share of attention parameters kept


def headtensor_proxy(method: str) -> Proxy:
    """q, k, v and o per head as 3-way tensors: each layer's mean squared relative error of the decomposition
    ``compress`` fits to each whitened projection tensor."""
    @torch.no_grad()
    def proxy(ctx: PlanContext, budgets: tuple[float, ...]) -> list[list[float]]:
        targets = HeadTensorSettings().targets
        contexts = layer_contexts(ctx.model, ctx.family, ctx.stats, ctx.windows.shape[1])
        plans = [plan_head_tensor(ctx.anatomy, method, targets, ratio=budget) for budget in budgets]
        decomposer = DECOMPOSERS[method]
        errors = [[0.0] * ctx.anatomy.num_layers for _ in budgets]
        for index, unit in enumerate(plans[0].units):
            *_, whitened = whitened_unit(ctx.model, ctx.family, contexts, unit, True)
            for row, plan in zip(errors, plans, strict=True):
                ranks = unit_ranks(plan, index, whitened)
                if ranks is not None:
                    fit = decomposer.decompose(whitened.tensor, ranks, MAX_ITERATIONS, decomposer.TOLERANCE, ctx.request.seed)
                    row[unit.layer] += fit.relative_error ** 2 / len(targets)
        return errors
    return proxy


def headtensor_settings(method: str) -> Callable[[float, AttentionAnatomy], HeadTensorSettings]:
    return lambda budget, anatomy: HeadTensorSettings(method=method, ratio=budget)


register_planned(*(PlannedMethod(m, PARAMETER_BUDGETS, (0.5, 0.8), headtensor_settings(m), headtensor_proxy(m))
                   for m in (tucker.NAME, cp.NAME)))
