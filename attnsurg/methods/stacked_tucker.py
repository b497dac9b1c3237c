"""One Tucker decomposition per attention layer, q, k, v and o together: ``compress --method tucker --stacked``.

TensorLLM (Gu et al. 2025, sec. III) stacks every head's four projections into one hidden x head_dim x 4 x
heads tensor and decomposes it with factors shared by all heads. Here the projection and head modes keep
full rank (one core per projection and head), which is what lets GQA keep its G key/value heads. With
W~_{p,h} the head_dim x hidden block of projection p in {q, k, v, o} for head h (o: W_o[:, h]^T),

    W~_{p,h} ~ B C_{p,h} A^T,    A: hidden x R_hidden, B: head_dim x R_dim, C_{p,h}: R_dim x R_hidden,

A and B are shared by every head *and* every projection. A token's hidden state is projected once (u = x A,
R_hidden values) for q, k and v together, o writes back through the same A, and where R_hidden < 2 G d the
cache holds u instead of K and V. At R_dim = head_dim, B is folded into the cores.

Fitting. TensorLLM decomposes the raw weights (data-free); that decomposition (tensorly's partial_tucker on
the stacked tensor, each projection scaled to unit norm) is only the start here. Alternating least squares
then fits the activation-aware objective (float64)

    f = sum_{p,h} w_p || M_{p,h}^1/2 (W~_{p,h} - B C_{p,h} A^T) R_p^1/2 ||_F^2

with R = Sigma_x, the attention input's second moment, for q/k/v and R = I for o (its hidden mode is its
output); M the per-head consumer blocks of q/k/v (as in lowrank.py; I when unweighted) and the per-head
block of o's input second moment for o (cross-head terms ignored); w_p = 1 / (projection p's whitened energy)
so q, k, v and o count alike. Every step minimizes f over one block exactly, so f never rises.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field

import tensorly as tl
import torch
from tensorly.decomposition import partial_tucker

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import Family
from attnsurg.calibrate import InputStatistics
from attnsurg.errors import UserError
from attnsurg.methods.base import CardText, CompressMethod, LayerTensors, register_method
from attnsurg.methods.factorized import factorized_card_text, factorized_record, factorized_text
from attnsurg.methods.head_whitening import diagonal_blocks
from attnsurg.methods.headtensor import HeadTensorSettings, budget_line, warn_unconverged
from attnsurg.methods.consumers import LayerContext
from attnsurg.methods.lowrank import unsupported_reason

MAX_ITERATIONS = 50
TOLERANCE = 1e-4  # stop when a sweep lowers the objective by less than this fraction
PROJECTION_ORDER = ("q", "k", "v", "o")


@dataclass(frozen=True)
class LayerUnit:
    """The four projections of one layer as head_dim x hidden slices: q heads, k heads, v heads, o heads."""

    layer: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    name = "qkvo"

    @property
    def heads_per_projection(self) -> tuple[int, int, int, int]:
        return self.heads, self.kv_heads, self.kv_heads, self.heads

    @property
    def slices(self) -> int:
        return sum(self.heads_per_projection)

    def projection_slices(self) -> list[tuple[str, slice]]:
        """Each projection's name and its slices."""
        bounds = [0, *itertools.accumulate(self.heads_per_projection)]
        return [(name, slice(a, b)) for name, a, b in zip(PROJECTION_ORDER, bounds, bounds[1:])]

    @property
    def reads(self) -> int:
        """Slices that read the hidden state (q, k, v); the rest (o) write it."""
        return self.heads + 2 * self.kv_heads

    @property
    def dense_params(self) -> int:
        return self.slices * self.head_dim * self.hidden

    @property
    def label(self) -> str:
        return f"layer {self.layer} q,k,v,o"


def dim_factor_params(unit: LayerUnit, r_dim: int) -> int:
    return 0 if r_dim == unit.head_dim else unit.head_dim * r_dim  # full rank: folded into the cores


def parameters(unit: LayerUnit, ranks: tuple[int, int]) -> int:
    r_dim, r_hidden = ranks
    return unit.hidden * r_hidden + dim_factor_params(unit, r_dim) + unit.slices * r_dim * r_hidden


def flops(unit: LayerUnit, ranks: tuple[int, int]) -> int:
    """Per token: x A once for q, k and v, A^T once for o; per slice R_hidden <-> R_dim (<-> head_dim via B)."""
    r_dim, r_hidden = ranks
    return 2 * (2 * unit.hidden * r_hidden + unit.slices * r_dim * r_hidden + unit.slices * dim_factor_params(unit, r_dim))


def check_ranks(unit: LayerUnit, ranks: tuple[int, ...]) -> None:
    if len(ranks) != 2 or not (1 <= ranks[0] <= unit.head_dim and 1 <= ranks[1] <= unit.hidden):
        raise UserError(
            f"--ranks {','.join(map(str, ranks))} does not fit --stacked: give 2 ranks (head_dim, hidden), from 1 to "
            f"{unit.head_dim} and from 1 to {unit.hidden}"
        )


def ranks_for_budget(unit: LayerUnit, budget: int) -> tuple[int, int]:
    """Full head_dim (B folded away), the hidden rank the budget allows."""
    return unit.head_dim, min(unit.hidden, budget // (unit.hidden + unit.slices * unit.head_dim))


@dataclass
class StackedTuckerPlan:
    units: list[LayerUnit]
    ranks: list[tuple[int, int]]  # per layer: (R_dim, R_hidden)
    kv_values_per_layer: int
    weighted: bool = True
    max_iterations: int = MAX_ITERATIONS  # sweeps per fit; 0: TensorLLM's data-free factors, only the cores fitted
    method = "tucker"
    stacked = True
    targets = PROJECTION_ORDER
    kv_latent = False
    allocate = False
    choose_ranks = False

    def params(self, unit: LayerUnit, ranks: tuple[int, int] | None) -> int:
        return unit.dense_params if ranks is None else parameters(unit, ranks)

    def flops(self, unit: LayerUnit, ranks: tuple[int, int] | None) -> int:
        return 2 * unit.dense_params if ranks is None else flops(unit, ranks)

    def unit_params(self, index: int, after: bool) -> int:
        return self.params(self.units[index], self.ranks[index] if after else None)

    @property
    def columns(self) -> list[str]:
        """The rank columns of the card's table."""
        return ["qkvo"]

    def params_before(self) -> int:
        return sum(u.dense_params for u in self.units)

    def params_after(self) -> int:
        return sum(parameters(u, r) for u, r in zip(self.units, self.ranks))

    def flops_before(self) -> int:
        return 2 * self.params_before()

    def flops_after(self) -> int:
        return sum(flops(u, r) for u, r in zip(self.units, self.ranks))

    @property
    def kept_fraction(self) -> float:
        return self.params_after() / self.params_before()

    def rank_label(self, index: int) -> str:
        return "x".join(map(str, self.ranks[index]))

    def caches_latent(self, index: int) -> bool:
        return self.ranks[index][1] < self.kv_values_per_layer

    def kv_values_after(self) -> int:
        return sum(r[1] if self.caches_latent(i) else self.kv_values_per_layer for i, r in enumerate(self.ranks))

    def surgery(self, family: Family) -> dict:
        layers = {str(u.layer): {"ranks": list(r), "cache_latent": self.caches_latent(i)}
                  for i, (u, r) in enumerate(zip(self.units, self.ranks))}
        return {"format": 1, "method": "tucker", "stacked_tucker": layers}


def plan_stacked_tucker(
    anatomy: AttentionAnatomy,
    targets: tuple[str, ...],
    ratio: float | None = None,
    ranks: tuple[int, ...] | None = None,
    weighted: bool = True,
) -> StackedTuckerPlan:
    reason = unsupported_reason(anatomy)
    if reason:
        raise UserError(f"cannot compress this model: {reason}")
    if tuple(sorted(targets)) != tuple(sorted(PROJECTION_ORDER)):
        raise UserError("--stacked decomposes q, k, v and o of a layer together: drop --targets (or give q,k,v,o)")
    if (ratio is None) == (ranks is None):
        raise UserError("give the budget as exactly one of --ratio or --ranks head_dim,hidden")
    units = [LayerUnit(layer, anatomy.num_heads, anatomy.num_kv_heads, anatomy.head_dim, anatomy.hidden_size)
             for layer in range(anatomy.num_layers)]
    plan = StackedTuckerPlan(units, [], anatomy.kv_values_per_layer, weighted)
    if ranks is not None:
        check_ranks(units[0], tuple(ranks))
        plan.ranks = [(ranks[0], ranks[1])] * len(units)
        return plan
    if not 0 < ratio <= 1:
        raise UserError(f"--ratio must be in (0, 1], got {ratio}")
    plan.ranks = [ranks_for_budget(u, int(ratio * u.dense_params)) for u in units]
    if min(r[1] for r in plan.ranks) < 1:
        raise UserError(f"--ratio {ratio} leaves --stacked no hidden rank at all; use a larger ratio")
    return plan


# --- the objective --------------------------------------------------------------------------------------


@dataclass
class StackedLayer:
    """One layer's slices (float64) and the metrics of its objective."""

    unit: LayerUnit
    W: torch.Tensor  # [slices, d, D]
    M: torch.Tensor  # [slices, d, d]: left metrics
    sigma: torch.Tensor  # [D, D]: right metric of the reading slices (o: I)
    weight: torch.Tensor  # [slices]: w_p of each slice's projection
    eig: tuple[torch.Tensor, torch.Tensor] = field(init=False)  # sigma = U diag(lambda) U^T

    def __post_init__(self) -> None:
        values, vectors = torch.linalg.eigh(self.sigma)
        self.eig = (values.clamp_min(0), vectors)

    @property
    def reads(self) -> slice:
        return slice(0, self.unit.reads)

    @property
    def writes(self) -> slice:
        return slice(self.unit.reads, self.unit.slices)

    def errors(self, E: torch.Tensor) -> torch.Tensor:
        """Per slice ||M^1/2 E R^1/2||_F^2 for residuals E [slices, d, D]."""
        ME = self.M @ E
        reads = torch.einsum("sij,jk,sik->s", ME[self.reads], self.sigma, E[self.reads])
        writes = (ME[self.writes] * E[self.writes]).sum((1, 2))
        return torch.cat([reads, writes])

    def objective(self, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> float:
        return float((self.weight * self.errors(self.W - B @ C @ A.T)).sum())


def stack_layer(unit: LayerUnit, attn: torch.nn.Module, x: InputStatistics, o: InputStatistics,
                ctx: LayerContext | None) -> StackedLayer:
    """The slices of one attention layer, with consumer blocks for q/k/v when ``ctx`` is given."""
    H, G, d, D = unit.heads, unit.kv_heads, unit.head_dim, unit.hidden
    weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    W = torch.cat([w.detach().double().view(-1, d, D) for w in weights]
                  + [attn.o_proj.weight.detach().double().view(D, H, d).permute(1, 2, 0)])
    if ctx is None:
        reading = torch.eye(d, dtype=torch.float64).expand(unit.reads, d, d)
    else:
        consumers = (ctx.query_weight(), ctx.key_weight(), ctx.value_weight())
        reading = torch.cat([diagonal_blocks(m, n, d) for m, n in zip(consumers, (H, G, G))])
    M = torch.cat([reading, diagonal_blocks(o.sigma[:-1, :-1], H, d)])
    layer = StackedLayer(unit, W, M, x.sigma[:-1, :-1], torch.ones(unit.slices, dtype=torch.float64))
    energy = layer.errors(W)
    for _, part in unit.projection_slices():
        layer.weight[part] = 1 / energy[part].sum().clamp_min(1e-300)
    return layer


# --- alternating least squares --------------------------------------------------------------------------


def fit_cores(layer: StackedLayer, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Every C_s given A and B: C_s = (B^T M_s B)^-1 B^T M_s W_s R_s A (A^T R_s A)^-1."""
    left = B.T @ layer.M @ B  # [slices, R_dim, R_dim]
    projected = B.T @ layer.M @ layer.W  # [slices, R_dim, D]
    right_reads, right_writes = layer.sigma @ A, A
    Z = torch.cat([projected[layer.reads] @ right_reads, projected[layer.writes] @ right_writes])
    C = torch.linalg.solve(ridged(left), Z)
    for part, right in ((layer.reads, right_reads), (layer.writes, right_writes)):
        gram = ridged(A.T @ right)
        C[part] = torch.linalg.solve(gram, C[part].transpose(1, 2)).transpose(1, 2)  # gram is symmetric
    return C


def fit_hidden(layer: StackedLayer, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """A given B and the cores. Setting the gradient to zero gives Sigma A P + A Q = Sigma F_r + F_w with
    P, Q = sum_s w_s K_s^T M_s K_s (K_s = B C_s) over the reading and the writing slices and
    F = sum_s w_s W_s^T M_s K_s. With Sigma = U diag(lambda) U^T, P = L L^T and L^-1 Q L^-T = V diag(theta) V^T,
    row i of U^T A is (U^T rhs)_i L^-T V diag(1 / (lambda_i + theta)) V^T L^-1: exact, with no D R^2 x R^2 system."""
    K = B @ C  # [slices, d, R_hidden]
    MK = layer.M @ K
    w = layer.weight[:, None, None]
    gram = w * (K.transpose(1, 2) @ MK)
    P, Q = ridged(gram[layer.reads].sum(0)), gram[layer.writes].sum(0)
    F = w * (layer.W.transpose(1, 2) @ MK)  # [slices, D, R_hidden]
    rhs = layer.sigma @ F[layer.reads].sum(0) + F[layer.writes].sum(0)
    values, U = layer.eig
    L = torch.linalg.cholesky(P)
    L_inv = torch.linalg.solve_triangular(L, torch.eye(L.shape[0], dtype=L.dtype), upper=False)
    theta, V = torch.linalg.eigh(L_inv @ Q @ L_inv.T)
    T = L_inv.T @ V  # (lambda P + Q)^-1 = T diag(1 / (lambda + theta)) T^T
    rotated = ((U.T @ rhs) @ T) / (values[:, None] + theta.clamp_min(0)[None, :]).clamp_min(1e-300)
    return U @ (rotated @ T.T)


def fit_dim(layer: StackedLayer, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, steps: int = 100) -> torch.Tensor:
    """B given A and the cores: sum_s w_s M_s B N_s = sum_s w_s M_s W_s R_s A C_s^T with N_s = C_s A^T R_s A C_s^T,
    a Kronecker-sum system of head_dim x R_dim unknowns, solved by conjugate gradients from the current B."""
    w = layer.weight[:, None, None]
    RA = torch.cat([(layer.sigma @ A).expand(layer.unit.reads, -1, -1), A.expand(layer.unit.slices - layer.unit.reads, -1, -1)])
    N = w * (C @ (A.T @ RA) @ C.transpose(1, 2))  # [slices, R_dim, R_dim]
    rhs = (w * (layer.M @ layer.W @ RA @ C.transpose(1, 2))).sum(0)

    def apply(X: torch.Tensor) -> torch.Tensor:
        return (layer.M @ X @ N).sum(0)

    X = B.clone()
    residual = rhs - apply(X)
    direction = residual.clone()
    norm = (residual * residual).sum()
    target = 1e-20 * (rhs * rhs).sum()
    for _ in range(steps):
        if norm <= target:
            break
        image = apply(direction)
        step = norm / (direction * image).sum().clamp_min(1e-300)
        X = X + step * direction
        residual = residual - step * image
        new_norm = (residual * residual).sum()
        direction = residual + (new_norm / norm) * direction
        norm = new_norm
    return X


def ridged(gram: torch.Tensor) -> torch.Tensor:
    """gram + a relative ridge of 1e-10 of its mean diagonal, so rank-deficient data still solves."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-300)
    return gram + 1e-10 * scale[..., None, None] * eye


def data_free_start(layer: StackedLayer, ranks: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TensorLLM's own factors: partial Tucker (HOOI) of the raw slices, each projection at unit norm."""
    scale = torch.empty(layer.unit.slices, dtype=torch.float64)
    for _, part in layer.unit.projection_slices():
        scale[part] = layer.W[part].pow(2).sum().rsqrt()
    with tl.backend_context("pytorch"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Trying to compute SVD")
        (_, factors), _ = partial_tucker(layer.W * scale[:, None, None], rank=list(ranks), modes=[1, 2],
                                         n_iter_max=10, init="svd", tol=1e-4, random_state=seed)
    return factors[1], factors[0]  # A [D, R_hidden], B [d, R_dim]


@dataclass
class StackedFit:
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    relative_error: float  # sqrt(f / f(0)): f(0) sums w_p over the four projections
    converged: bool
    objectives: list[float]


def fit_layer(layer: StackedLayer, ranks: tuple[int, int], seed: int, max_iterations: int = MAX_ITERATIONS,
              tolerance: float = TOLERANCE) -> StackedFit:
    """Alternating exact block updates from the data-free start, until a sweep gains less than ``tolerance``."""
    A, B = data_free_start(layer, ranks, seed)
    full_dim = ranks[0] == layer.unit.head_dim
    if full_dim:
        B = torch.eye(layer.unit.head_dim, dtype=torch.float64)
    C = fit_cores(layer, A, B)
    objectives = [layer.objective(A, B, C)]
    total = float(layer.weight @ layer.errors(layer.W))
    converged = False
    for _ in range(max_iterations):
        A = torch.linalg.qr(fit_hidden(layer, B, C))[0]
        C = fit_cores(layer, A, B)
        if not full_dim:
            B = torch.linalg.qr(fit_dim(layer, A, B, C))[0]
            C = fit_cores(layer, A, B)
        objectives.append(layer.objective(A, B, C))
        if objectives[-2] - objectives[-1] <= tolerance * objectives[-2] or objectives[-1] <= 1e-24 * total:
            converged = True
            break
    return StackedFit(A, B, C, math.sqrt(max(objectives[-1], 0.0) / total), converged, objectives)


def module_state(unit: LayerUnit, fit: StackedFit, attn: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of the layer's StackedTuckerAttention (names as in modeling_attnsurg.py)."""
    state = {"factor_hidden": fit.A}
    if fit.B.shape[1] < unit.head_dim:
        state["factor_dim"] = fit.B
        cores = fit.C
    else:
        cores = fit.B @ fit.C  # B is square: fold it into the cores
    for name, part in unit.projection_slices():
        state[f"core_{name}"] = cores[part]
        bias = getattr(attn, f"{name}_proj").bias
        if bias is not None:
            state[f"{name}_bias"] = bias.detach()
    for norm in ("q_norm", "k_norm"):  # Qwen3: the rebuilt queries and keys go through the layer's own norms
        if getattr(attn, norm, None) is not None:
            state[f"{norm}.weight"] = getattr(attn, norm).weight.detach()
    return state


RANK_NOTE = ("Stacked Tucker ranks are head_dim x hidden: one hidden factor per layer, computed once per token for "
             "q, k and v of every head and shared by o; one core per projection and head.")


class StackedTucker(CompressMethod):
    """``compress --method tucker --stacked`` (TensorLLM layout)."""

    names = ("tucker",)
    settings = HeadTensorSettings
    plan_type = StackedTuckerPlan
    timed_step = "factorization"

    def handles(self, settings) -> bool:
        return super().handles(settings) and settings.stacked

    def plan(self, anatomy: AttentionAnatomy, settings) -> StackedTuckerPlan:
        return plan_stacked_tucker(anatomy, settings.targets, settings.ratio, settings.ranks, settings.weighted)

    def operate_layer(self, plan: StackedTuckerPlan, family: Family, index: int, context: LayerContext,
                      seed: int) -> LayerTensors:
        """The layer's q, k, v, o fitted together; it replaces the whole attention."""
        attention = f"{family.layers_path}.{index}.{family.attention_attr}"
        tensors = LayerTensors()
        for unit, ranks in zip(plan.units, plan.ranks, strict=True):
            if unit.layer == index:
                stacked = stack_layer(unit, context.attn, context.x, context.o, context if plan.weighted else None)
                fit = fit_layer(stacked, ranks, seed, plan.max_iterations)
                tensors.replaced[attention] = module_state(unit, fit, context.attn)
                tensors.records.append(fit.relative_error)
                if plan.max_iterations and not fit.converged:
                    tensors.unconverged.append((unit.label, fit.relative_error))
        return tensors

    def warn_capped(self, plan: StackedTuckerPlan, unconverged: list[tuple[str, float]], total: int) -> None:
        warn_unconverged(unconverged, total, "stacked Tucker fits", f"{plan.max_iterations} sweeps", TOLERANCE)

    def plan_record(self, plan, anatomy: AttentionAnatomy) -> dict:
        return factorized_record(plan, anatomy)

    def plan_text(self, model: str, plan, anatomy: AttentionAnatomy, dry_run: bool) -> list:
        return factorized_text(model, plan, anatomy, dry_run)

    def plan_card_text(self, settings, plan: StackedTuckerPlan, anatomy: AttentionAnatomy) -> CardText:
        kv_note = (" Where a layer's hidden rank is below the K and V width, its cache holds the shared hidden "
                   "coordinates x A (rebuilt to K and V at every step, RoPE applied after)."
                   if plan.kv_values_after() < anatomy.kv_values_per_token else "")
        layout = "; q, k, v and o of each layer stacked in one decomposition (TensorLLM layout)"
        return factorized_card_text(
            plan, anatomy, "tensor-decomposed", budget_line(settings, plan, layout),
            fit_note="; alternating least squares on the calibration statistics, from TensorLLM's data-free factors",
            kv_note=kv_note, rank_note=RANK_NOTE)


register_method(StackedTucker())
