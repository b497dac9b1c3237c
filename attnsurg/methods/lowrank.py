"""Low-rank attention projections: ``compress --method svd|asvd|svdllm``.

Each targeted projection W (m x n, bias b kept as is) becomes ``up @ down`` of rank r, the minimizer of

    || L^T (W - W') R ||_F,

where R is the method's input metric (identity for svd, diag(E|x|^0.5) for asvd, the Cholesky factor of
E[x x^T] for svdllm; see each method's module) and L L^T = Omega an optional output weight: what consumes the
projection's output (Eckart-Young on M = L^T W R; W' = L^-T U_r S_r V_r^T R^-1, split as
down = S_r^1/2 V_r^T R^-1 and up = L^-T U_r S_r^1/2).

Consumer weights (on by default for svdllm; ``methods/consumers.py``): the rotation-averaged query moment weights
keys, the key moment weights queries and W_o^T W_o weights values. Each block is rescaled to its unweighted
energy.

``kv_latent``: k and v of a layer share one latent of rank r (W = [W_k; W_v]), which the cache holds
instead of K and V (Palu, Chang et al. 2024): a real KV-cache saving of r / (2 G d).

``allocate``: one global budget spread over all layers and projections by greedy water-filling on the
relative truncation energy per unit of cost (parameters, or cached values for latents), which is optimal
for the sum of relative errors since each spectrum is sorted; every unit keeps at least 3/4 of its
uniform rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import SURGERY_FAMILIES, Family, blocking_features
from attnsurg.errors import UserError
from attnsurg.linalg import augmented, rescaled, sqrt_and_inverse_sqrt
from attnsurg.methods import MethodSpec, asvd, register, svd, svdllm
from attnsurg.methods.consumers import PROJECTIONS, LayerContext, layer_contexts
from attnsurg.methods.rank_allocation import allocated_ranks
from attnsurg.methods.base import CardText, CompressMethod, LayerTensors, register_method
from attnsurg.methods.factorized import factorized_card_text, factorized_record, factorized_text
from attnsurg.methods.planning import PlanContext, PlannedMethod, Proxy, register_planned
from attnsurg.recipe import CompressSettings, ratio_unless_ranked

METRICS = {module.NAME: module for module in (svd, asvd, svdllm)}


def unsupported_reason(anatomy: AttentionAnatomy) -> str | None:
    if anatomy.model_type not in SURGERY_FAMILIES:
        return f"the {anatomy.model_type} family is not supported yet ({blocking_features(anatomy)})"
    return None


for _module in METRICS.values():
    register(MethodSpec(_module.NAME, _module.SUMMARY, unsupported_reason))


@dataclass(frozen=True)
class Unit:
    """One factorized map: a projection (q/k/v/o) of one layer, or the joint k/v latent ("kv")."""

    layer: int
    name: str
    out_features: int
    in_features: int

    @property
    def full_rank(self) -> int:
        return min(self.out_features, self.in_features)

    @property
    def break_even(self) -> int:
        """The rank at which the two factors hold as many parameters as the dense matrix."""
        return self.out_features * self.in_features // (self.out_features + self.in_features)

    @property
    def rank_cost(self) -> int:
        """What one more rank costs: a cached value per token for a latent, else parameters."""
        return 1 if self.name == "kv" else self.out_features + self.in_features

    def params(self, rank: int | None) -> int:
        dense = self.out_features * self.in_features
        return dense if rank is None else rank * (self.out_features + self.in_features)

    @property
    def label(self) -> str:
        return f"layer {self.layer} {'k/v latent' if self.name == 'kv' else PROJECTIONS[self.name]}"


@dataclass
class LowRankPlan:
    method: str
    targets: tuple[str, ...]
    kv_latent: bool
    weighted: bool
    allocate: bool
    units: list[Unit]
    ranks: list[int | None]  # per unit; None keeps it dense
    kv_values_per_layer: int  # original 2 G d

    def params_before(self) -> int:
        return sum(u.params(None) for u in self.units)

    def params_after(self) -> int:
        return sum(u.params(r) for u, r in zip(self.units, self.ranks))

    def flops_before(self) -> int:
        """Per token in the targeted projections (2 per multiply-add)."""
        return 2 * self.params_before()

    def flops_after(self) -> int:
        return 2 * self.params_after()

    def rank_label(self, index: int) -> str:
        rank = self.ranks[index]
        return "dense" if rank is None else str(rank)

    def unit_params(self, index: int, after: bool) -> int:
        return self.units[index].params(self.ranks[index] if after else None)

    @property
    def columns(self) -> list[str]:
        """The rank columns of the card's table: one per targeted projection, or the k/v latent."""
        return ["kv"] if self.kv_latent else list(self.targets)

    @property
    def kept_fraction(self) -> float:
        if self.kv_latent:
            return self.kv_values_after() / (self.kv_values_per_layer * len(self.units))
        return self.params_after() / self.params_before()

    def kv_values_after(self) -> int:
        """Cached values per token, all layers."""
        if not self.kv_latent:
            return self.kv_values_per_layer * len({u.layer for u in self.units})
        return sum(r for r in self.ranks)

    def surgery(self, family: Family) -> dict:
        """The ``config.attnsurg`` record the modeling code rebuilds the modules from."""
        low_rank, latent = {}, {}
        for unit, rank in zip(self.units, self.ranks):
            if rank is None:
                continue
            if unit.name == "kv":
                latent[str(unit.layer)] = rank
            else:
                path = f"{family.layers_path}.{unit.layer}.{family.attention_attr}.{PROJECTIONS[unit.name]}"
                low_rank[path] = rank
        return {"format": 1, "method": self.method, "weighted": self.weighted, "low_rank": low_rank, "kv_latent": latent}


def parse_targets(targets: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    unknown = [t for t in names if t not in PROJECTIONS]
    if unknown or not names:
        raise UserError(f"unknown target {unknown[0] if unknown else '(none)'!r}; choose from q,k,v,o, e.g. --targets k,v")
    return tuple(t for t in PROJECTIONS if t in names)


def targets_of(value) -> tuple[str, ...]:
    """``"k,v"`` or ``[k, v]`` as projection names in q, k, v, o order."""
    try:
        return parse_targets(value)
    except UserError as exc:
        raise ValueError(str(exc)) from None


class LowRankSettings(CompressSettings):
    """``compress --method svd|asvd|svdllm``. The budget is ``ratio`` (the fraction of the targeted
    projections' parameters kept; with ``kv_latent``, of the KV cache) or one ``rank`` everywhere."""

    method: Literal["svd", "asvd", "svdllm"] = "svdllm"
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    ratio: float | None = Field(None, gt=0, le=1)
    rank: int | None = Field(None, gt=0)
    kv_latent: bool = False
    allocate: bool = False
    weighted: bool | None = None

    @field_validator("targets", mode="before")
    @classmethod
    def _projection_names(cls, value) -> tuple[str, ...]:
        return targets_of(value)

    @model_validator(mode="before")
    @classmethod
    def _default_budget(cls, data):
        return ratio_unless_ranked(data, ("rank",))


def plan_units(anatomy: AttentionAnatomy, targets: tuple[str, ...], kv_latent: bool) -> list[Unit]:
    D, Hd, Gd = anatomy.hidden_size, anatomy.num_heads * anatomy.head_dim, anatomy.num_kv_heads * anatomy.head_dim
    shapes = {"q": (Hd, D), "k": (Gd, D), "v": (Gd, D), "o": (D, Hd), "kv": (2 * Gd, D)}
    names = ("kv",) if kv_latent else targets
    return [Unit(layer, name, *shapes[name]) for layer in range(anatomy.num_layers) for name in names]


def check_latent_support(anatomy: AttentionAnatomy, targets: tuple[str, ...]) -> None:
    if set(targets) != {"k", "v"}:
        raise UserError("--kv-latent compresses k and v together into the cached latent; use --targets k,v")


def uniform_ranks(units: list[Unit], ratio: float | None, rank: int | None, kv_latent: bool) -> list[int | None]:
    if rank is not None:
        if rank < 1:
            raise UserError(f"--rank must be at least 1, got {rank}")
        for unit in units:
            if rank > unit.full_rank:
                raise UserError(
                    f"--rank {rank} exceeds the full rank {unit.full_rank} of {unit.label} "
                    f"({unit.out_features} x {unit.in_features}); use at most {unit.full_rank}"
                )
        return [rank] * len(units)
    if ratio is None or not 0 < ratio <= 1:
        raise UserError(f"--ratio must be in (0, 1], got {ratio}")
    ranks: list[int | None] = []
    for unit in units:
        if kv_latent:
            ranks.append(min(unit.full_rank, max(1, round(ratio * unit.out_features))))
            continue
        r = int(ratio * unit.out_features * unit.in_features / (unit.out_features + unit.in_features))
        if r < 1:
            raise UserError(f"--ratio {ratio} leaves {unit.label} no rank at all; use a larger ratio")
        ranks.append(None if r >= unit.break_even else r)
    return ranks


def plan_lowrank(
    anatomy: AttentionAnatomy,
    method: str,
    targets: str | tuple[str, ...],
    ratio: float | None = None,
    rank: int | None = None,
    kv_latent: bool = False,
    allocate: bool = False,
    weighted: bool | None = None,
) -> LowRankPlan:
    """Validate a request against the model and give each unit its (uniform) rank; nothing is loaded."""
    if method not in METRICS:
        raise UserError(f"unknown low-rank method '{method}'; choose from {', '.join(METRICS)}")
    reason = unsupported_reason(anatomy)
    if reason:
        raise UserError(f"cannot compress this model: {reason}")
    targets = parse_targets(targets)
    if (ratio is None) == (rank is None):
        raise UserError("give the budget as exactly one of --ratio or --rank")
    if kv_latent:
        check_latent_support(anatomy, targets)
    units = plan_units(anatomy, targets, kv_latent)
    ranks = uniform_ranks(units, ratio, rank, kv_latent)
    return LowRankPlan(
        method=method,
        targets=targets,
        kv_latent=kv_latent,
        weighted=(method == "svdllm") if weighted is None else weighted,
        allocate=allocate,
        units=units,
        ranks=ranks,
        kv_values_per_layer=anatomy.kv_values_per_layer,
    )


# --- factorization ----------------------------------------------------------------------------------------


@dataclass
class Decomposition:
    """SVD of M = L^T W R and what maps its truncations back to factors of W."""

    U: torch.Tensor
    S: torch.Tensor
    Vh: torch.Tensor
    R_inv: torch.Tensor
    L_inv_T: torch.Tensor | None
    bias: torch.Tensor | None

    def relative_error(self, rank: int) -> float:
        energy = self.S.pow(2)
        return float((energy[rank:].sum() / energy.sum().clamp_min(1e-300)).detach())

    def factors(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(down [r, n], up [m, r]) with the singular values split evenly between them."""
        root = self.S[:rank].sqrt()
        down = (root[:, None] * self.Vh[:rank]) @ self.R_inv
        up = self.U[:, :rank] * root
        if self.L_inv_T is not None:
            up = self.L_inv_T @ up
        return down, up


def unit_weights(unit: Unit, attn) -> tuple[torch.Tensor, torch.Tensor | None]:
    if unit.name == "kv":
        W = torch.cat([attn.k_proj.weight, attn.v_proj.weight]).double()
        biases = attn.k_proj.bias, attn.v_proj.bias
        bias = None if biases[0] is None else torch.cat(biases).double()
        return W, bias
    linear = getattr(attn, PROJECTIONS[unit.name])
    return linear.weight.double(), None if linear.bias is None else linear.bias.double()


def consumer_weight(unit: Unit, ctx: LayerContext, W: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Omega for the unit (None for o_proj, whose output goes straight to the residual stream)."""
    sigma = ctx.o.sigma if unit.name == "o" else ctx.x.sigma
    energy = augmented(W, bias) @ sigma @ augmented(W, bias).T
    if unit.name == "o":
        return None
    if unit.name == "q":
        return rescaled(ctx.query_weight(), energy)
    if unit.name == "k":
        return rescaled(ctx.key_weight(), energy)
    if unit.name == "v":
        return rescaled(ctx.value_weight(), energy)
    n = W.shape[0] // 2
    return torch.block_diag(
        rescaled(ctx.key_weight(), energy[:n, :n]), rescaled(ctx.value_weight(), energy[n:, n:])
    )


def decompose(unit: Unit, ctx: LayerContext, method: str, weighted: bool) -> Decomposition:
    W, bias = unit_weights(unit, ctx.attn)
    R, R_inv = METRICS[method].input_metric(ctx.o if unit.name == "o" else ctx.x)
    M = W @ R
    L_inv_T = None
    if weighted:
        omega = consumer_weight(unit, ctx, W, bias)
        if omega is not None:
            root, L_inv_T = sqrt_and_inverse_sqrt(omega)
            M = root @ M
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    return Decomposition(U, S, Vh, R_inv, L_inv_T, bias)


# --- assembly ---------------------------------------------------------------------------------------------


def unit_state(unit: Unit, family: Family, down: torch.Tensor, up: torch.Tensor,
               bias: torch.Tensor | None) -> dict[str, dict[str, torch.Tensor]]:
    """Module path -> the tensors it holds once the unit is factorized (an empty dict: the module is gone)."""
    prefix = f"{family.layers_path}.{unit.layer}.{family.attention_attr}."
    up_state = {"weight": up} if bias is None else {"weight": up, "bias": bias}
    if unit.name == "kv":
        return {prefix + "k_proj": {}, prefix + "v_proj": {}, prefix + "kv_down": {"weight": down}, prefix + "kv_up": up_state}
    return {prefix + PROJECTIONS[unit.name]: {"down.weight": down, **{f"up.{k}": v for k, v in up_state.items()}}}


class LowRank(CompressMethod):
    """``compress --method svd|asvd|svdllm``."""

    names = ("svd", "asvd", "svdllm")
    settings = LowRankSettings
    plan_type = LowRankPlan
    timed_step = "factorization"

    def plan(self, anatomy: AttentionAnatomy, settings) -> LowRankPlan:
        return plan_lowrank(anatomy, settings.method, settings.targets, settings.ratio, settings.rank,
                            settings.kv_latent, settings.allocate, settings.weighted)

    def operate_layer(self, plan: LowRankPlan, family: Family, index: int, context: LayerContext, seed: int) -> LayerTensors:
        tensors = LayerTensors()
        for unit, rank in zip(plan.units, plan.ranks, strict=True):
            if unit.layer != index:
                continue
            if rank is None:  # kept dense
                tensors.records.append(0.0)
                continue
            decomposition = decompose(unit, context, plan.method, plan.weighted)
            tensors.replaced.update(unit_state(unit, family, *decomposition.factors(rank), decomposition.bias))
            tensors.records.append(decomposition.relative_error(rank))
        return tensors

    def needs_survey(self, plan: LowRankPlan) -> bool:
        return plan.allocate  # the ranks are allocated over every unit's spectrum

    def survey_layer(self, plan: LowRankPlan, index: int, context: LayerContext) -> list[torch.Tensor]:
        return [decompose(unit, context, plan.method, plan.weighted).S for unit in plan.units if unit.layer == index]

    def surveyed(self, plan: LowRankPlan, surveys: list[list[torch.Tensor]]) -> None:
        plan.ranks = allocated_ranks(plan.units, [spectrum for layer in surveys for spectrum in layer], plan.ranks)

    def plan_record(self, plan, anatomy: AttentionAnatomy) -> dict:
        return factorized_record(plan, anatomy)

    def plan_text(self, model: str, plan, anatomy: AttentionAnatomy, dry_run: bool) -> list:
        return factorized_text(model, plan, anatomy, dry_run)

    def plan_card_text(self, settings, plan: LowRankPlan, anatomy: AttentionAnatomy) -> CardText:
        budget = f"ratio {settings.ratio}" if settings.ratio is not None else f"rank {settings.rank}"
        kind = "fraction of the KV cache kept" if plan.kv_latent else "fraction of the targeted parameters kept"
        spread = "allocated over layers by truncation energy" if plan.allocate else "uniform ranks"
        kv_note = (
            " k and v share one cached latent per layer, so the KV cache holds the latent only. At every step the keys "
            "are rebuilt from it (RoPE applied after: 2 x rank x G d FLOPs per cached token); the values are not, the "
            "attention weights mix the latent, which each head's value rows then map (2 x rank x H FLOPs per cached token)."
            if plan.kv_latent else ""
        )
        return factorized_card_text(plan, anatomy, "low-rank",
                                    f"budget: {budget} ({kind}; achieved {plan.kept_fraction:.3f}), {spread}",
                                    kv_note=kv_note)


register_method(LowRank())


# ------------------------------------------------------------------------------------- analyze plan
KV_BUDGETS = (0.125, 0.1875, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75, 0.875)  # the share of the KV cache kept


def lowrank_proxy(method: str, allocate: bool = False) -> Proxy:
    """A k/v latent's per-layer relative truncation energy in the method's own metric (the discarded share of
    the spectrum ``compress`` truncates), at uniform ranks or at those ``--allocate`` spreads the budget to."""
    @torch.no_grad()
    def proxy(ctx: PlanContext, budgets: tuple[float, ...]) -> list[list[float]]:
        contexts = layer_contexts(ctx.model, ctx.family, ctx.stats, ctx.windows.shape[1])
        units = plan_units(ctx.anatomy, ("k", "v"), kv_latent=True)
        spectra = [decompose(unit, contexts[unit.layer], method, weighted=method == "svdllm") for unit in units]

        def ranks_at(budget: float) -> list[int | None]:
            uniform = uniform_ranks(units, budget, None, True)
            return allocated_ranks(units, [s.S for s in spectra], uniform) if allocate else uniform

        return [[s.relative_error(rank) if rank is not None else 0.0 for s, rank in zip(spectra, ranks_at(budget), strict=True)]
                for budget in budgets]
    return proxy


def lowrank_settings(method: str, allocate: bool = False) -> Callable[[float, AttentionAnatomy], LowRankSettings]:
    return lambda budget, anatomy: LowRankSettings(method=method, targets=("k", "v"), kv_latent=True, ratio=budget,
                                                   allocate=allocate)


register_planned(*(PlannedMethod(f"{m}{suffix}", KV_BUDGETS, (0.25, 0.5), lowrank_settings(m, allocate),
                                 lowrank_proxy(m, allocate))
                   for suffix, allocate in (("", False), ("-allocate", True)) for m in (svd.NAME, asvd.NAME, svdllm.NAME)))
