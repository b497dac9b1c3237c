"""Loki: PCA-scored top-k attention (Singhania et al. 2024, "Loki: Low-rank Keys for Efficient Sparse
Attention", sec. 3-4). ``compress --method loki --rank R --top-k K``.

Per layer and KV head, the keys' principal directions come from calibration statistics: the pre-RoPE key
second moment is K = [W_k b_k] E[x~ x~^T] [W_k b_k]^T (streamed in float64), and RoPE rotates a key at
position p by R_p, so the post-RoPE second moment over a window of L positions is E_p[R_p K R_p^T]
(computed exactly with consumers.rotation_average, assuming a key's content does not depend on its
position; through a q/k norm, as in Qwen3, K is the normed keys' moment linearised at their mean square,
consumers.attention_moments). ``--basis pre-rope`` uses the eigenvectors of K itself, as the paper's pre-rotary variant.
The bases go into the checkpoint; the weights are unchanged, so with R = head_dim and every key kept the
model is the original. The attention keeps the family's query scale, score soft-capping (Gemma 2), q/k norms
(Qwen3, Gemma 3) and sliding-window layers (a query's top-k is taken among the keys its window shows).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from pydantic import Field, field_validator
from transformers import PreTrainedModel

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import Family
from attnsurg.calibrate import InputStatistics, captured_inputs
from attnsurg.errors import UserError
from attnsurg.methods import MethodSpec, register
from attnsurg.methods.base import CardText, CompressMethod, LayerTensors, register_method
from attnsurg.methods.consumers import LayerContext, attention_moments, layer_inv_freq, rotation_average
from attnsurg.methods.lowrank import unsupported_reason
from attnsurg.methods.planning import PROXY_WINDOWS, PlanContext, PlannedMethod, layer_attention, register_planned
from attnsurg.recipe import CompressSettings
from attnsurg.sparsity import top_mass

NAME = "loki"
SUMMARY = "top-k attention with keys scored by their first R principal coordinates (Loki)"
BASES = ("post-rope", "pre-rope")


register(MethodSpec(NAME, SUMMARY, unsupported_reason))


@dataclass
class LokiPlan:
    rank: int | None  # one rank for every layer, or None: per layer from ``variance``
    top_k: int | float  # a count, or a fraction of each query's context
    basis: str
    num_layers: int
    kv_heads: int
    head_dim: int
    variance: float | None = None  # explained-variance threshold for per-layer ranks
    ranks: list[int] | None = None  # per layer, once calibrated

    def layer_ranks(self) -> list[int] | None:
        return self.ranks if self.ranks is not None else [self.rank] * self.num_layers if self.rank else None

    def rank_label(self) -> str:
        ranks = self.layer_ranks()
        if ranks is None:
            return f"per layer, {self.variance:g} of the key variance"
        spread = str(ranks[0]) if min(ranks) == max(ranks) else f"{min(ranks)}-{max(ranks)} (mean {sum(ranks) / len(ranks):.1f})"
        return spread + (f" for {self.variance:g} of the key variance" if self.variance else "")

    def surgery(self) -> dict:
        rank = self.rank if self.variance is None else self.ranks
        record = {"rank": rank, "top_k": self.top_k, "basis": self.basis}
        if self.variance is not None:
            record["variance"] = self.variance
        return {"format": 1, "method": NAME, "loki": record}


def parse_top_k(text: str) -> int | float:
    """'64' -> 64 keys; '0.25' or '1/4' -> a quarter of each query's context."""
    try:
        if "/" in text:
            numerator, denominator = text.split("/")
            value: int | float = float(numerator) / float(denominator)
        else:
            value = float(text) if "." in text else int(text)
    except (ValueError, ZeroDivisionError):
        raise UserError(f"--top-k expects a count (64) or a fraction of the context (0.25 or 1/4), got '{text}'") from None
    return value


def top_k_of(value):
    """``--top-k`` as given on the command line (``"64"``, ``"0.25"``, ``"1/4"``), or a number."""
    if not isinstance(value, str):
        return value
    try:
        return parse_top_k(value)
    except UserError as exc:
        raise ValueError(str(exc).removeprefix("--top-k ")) from None


class LokiSettings(CompressSettings):
    """``compress --method loki``: keys scored by ``rank`` principal coordinates, exact attention over the
    ``top_k`` best (a count of keys, or a float in (0, 1]: a fraction of each query's context)."""

    method: Literal["loki"] = "loki"
    rank: int | None = Field(None, gt=0)
    variance: float | None = Field(None, gt=0, le=1)  # instead of rank: per-layer ranks keeping this share of the key variance
    top_k: int | float | None = None
    basis: Literal["post-rope", "pre-rope"] = "post-rope"

    @field_validator("top_k", mode="before")
    @classmethod
    def _count_or_share(cls, value):
        return top_k_of(value)


def plan_loki(
    anatomy: AttentionAnatomy, rank: int | None, top_k: int | float | None, basis: str = "post-rope",
    variance: float | None = None,
) -> LokiPlan:
    reason = unsupported_reason(anatomy)
    if reason:
        raise UserError(f"cannot apply loki to this model: {reason}")
    d = anatomy.head_dim
    if rank is not None and variance is not None:
        raise UserError("give --rank or --variance, not both")
    if variance is not None and not 0 < variance <= 1:
        raise UserError(f"--variance is the share of the key variance the scores keep, in (0, 1], got {variance}")
    if variance is None and (rank is None or not 1 <= rank <= d):
        raise UserError(f"--rank must be between 1 and the head dim {d}, got {rank} (or give --variance)")
    if top_k is None or isinstance(top_k, float) and not 0 < top_k <= 1 or isinstance(top_k, int) and top_k < 1:
        raise UserError(f"--top-k must be a count >= 1 or a fraction in (0, 1], got {top_k}")
    if basis not in BASES:
        raise UserError(f"--basis must be one of {', '.join(BASES)}, got '{basis}'")
    return LokiPlan(rank, top_k, basis, anatomy.num_layers, anatomy.num_kv_heads, d, variance)


def key_bases(
    attn, x: InputStatistics, kv_heads: int, inv_freq: torch.Tensor, seq_len: int, basis: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """[G, d, d]: per KV head, orthonormal columns ordered by key energy (post- or pre-RoPE), and [G, d]:
    the energies (eigenvalues of the key second moment), largest first."""
    bases, energies = [], []
    positions = torch.arange(seq_len, dtype=torch.float64)
    for K in attention_moments(attn, "k", x.sigma, kv_heads):
        if basis == "post-rope":  # R_p K R_p^T = R_{-p}^T K R_{-p}
            K = rotation_average(K, inv_freq, -positions, torch.ones_like(positions))
        eigenvalues, eigenvectors = torch.linalg.eigh(K)
        order = eigenvalues.argsort(descending=True)
        bases.append(eigenvectors[:, order])
        energies.append(eigenvalues[order].clamp(min=0))
    return torch.stack(bases), torch.stack(energies)


def rank_for_variance(energies: torch.Tensor, variance: float) -> int:
    """The smallest rank whose leading coordinates hold ``variance`` of every KV head's key energy
    (Loki sec. 3: the rank at which the explained variance of the keys reaches a threshold)."""
    explained = energies.cumsum(dim=1) / energies.sum(dim=1, keepdim=True)
    per_head = (explained < variance - 1e-12).sum(dim=1) + 1
    return int(per_head.max().clamp(max=energies.shape[1]))


@torch.no_grad()
def layer_basis(attn, x: InputStatistics, plan: LokiPlan, inv_freq: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, int]:
    """One layer's key bases ([G, d, d]) and its rank: the plan's, or the one its ``variance`` asks for."""
    bases, energies = key_bases(attn, x, plan.kv_heads, inv_freq, seq_len, plan.basis)
    return bases, rank_for_variance(energies, plan.variance) if plan.variance is not None else plan.rank


def planned_surgery(plan: LokiPlan) -> dict:
    """The surgery record to plan a checkpoint's tensors by before any rank is known (the bases are [G, d, d]
    whatever the rank)."""
    return replace(plan, ranks=[plan.head_dim] * plan.num_layers).surgery() if plan.variance is not None else plan.surgery()


def has_loki(model: PreTrainedModel) -> bool:
    from attnsurg.modeling.modeling_attnsurg import LokiAttention

    return any(isinstance(m, LokiAttention) for m in model.modules())


@torch.no_grad()
def top_k_recall(model: PreTrainedModel, windows: torch.Tensor) -> float:
    """Mean fraction of the exact top-k keys (by full q . k) that the rank-r scores select, over every
    query, head and layer of the windows."""
    from attnsurg.modeling.modeling_attnsurg import LokiAttention

    attentions = [m for m in model.modules() if isinstance(m, LokiAttention)]
    if not attentions:
        raise UserError("this model has no Loki attention to measure")
    for attention in attentions:
        attention.recall = []
    try:
        device = next(model.parameters()).device
        for window in windows:
            model(input_ids=window[None].to(device), use_cache=False)
        values = [v for attention in attentions for v in attention.recall]
    finally:
        for attention in attentions:
            attention.recall = None
    return sum(values) / len(values)


class Loki(CompressMethod):
    """``compress --method loki``: the weights stay; each layer gains its key bases."""

    names = (NAME,)
    settings = LokiSettings
    plan_type = LokiPlan

    def plan(self, anatomy: AttentionAnatomy, settings) -> LokiPlan:
        return plan_loki(anatomy, settings.rank, settings.top_k, settings.basis, settings.variance)

    def operate_layer(self, plan: LokiPlan, family: Family, index: int, context: LayerContext, seed: int) -> LayerTensors:
        basis, rank = layer_basis(context.attn, context.x, plan, context.inv_freq, context.seq_len)
        attention = f"{family.layers_path}.{index}.{family.attention_attr}"
        return LayerTensors(added={f"{attention}.loki_basis": basis}, records=[rank])

    def surgery(self, plan: LokiPlan, family: Family) -> dict:
        return plan.surgery()

    def planned_surgery(self, plan: LokiPlan, family: Family) -> dict:
        return planned_surgery(plan)

    def apply_records(self, plan: LokiPlan, records: list) -> list[float]:
        plan.ranks = list(records)
        return []

    def plan_record(self, plan: LokiPlan, anatomy: AttentionAnatomy) -> dict:
        return {"rank": plan.rank, "ranks": plan.layer_ranks(), "variance": plan.variance, "top_k": plan.top_k,
                "basis": plan.basis}

    def plan_text(self, model: str, plan: LokiPlan, anatomy: AttentionAnatomy, dry_run: bool) -> list:
        top_k = f"{plan.top_k:g} of the context" if isinstance(plan.top_k, float) else f"{plan.top_k} keys"
        if plan.rank is not None:
            scoring = f"{plan.rank} of {plan.head_dim} principal coordinates"
        else:
            ranks = f"; ranks {plan.rank_label()}" if plan.ranks else " (set after calibration)"
            scoring = (f"its own rank, the fewest of {plan.head_dim} principal coordinates holding {plan.variance:g} "
                       f"of the key variance{ranks}")
        return [f"loki plan for {model}: every layer scores keys with {scoring} ({plan.basis} basis) and attends "
                f"over the top {top_k}"]

    def plan_card_text(self, settings, plan: LokiPlan, anatomy: AttentionAnatomy) -> CardText:
        top_k = f"{plan.top_k:g} of each query's context" if isinstance(plan.top_k, float) else f"{plan.top_k} keys"
        kv_bytes = f"{anatomy.kv_bytes_per_token('bfloat16'):,}"
        return CardText(
            title=f"with Loki top-k attention (rank {plan.rank_label()}, top-k {top_k})",
            summary=("Every layer scores keys with their first principal coordinates and attends exactly over the best "
                     "ones (Loki). The weights are the original's; the checkpoint adds one PCA basis per layer and KV head."),
            tags=["loki", "top-k-attention"],
            details=[f"rank {plan.rank_label()} of head dim {plan.head_dim}; top-k {top_k} (the current token always "
                     f"kept); {plan.basis} key basis"],
            figures=[{"metric": "KV bytes per token (bf16)", "before": kv_bytes,
                      "after": f"{kv_bytes} (keys cached rotated, full width)"}],
        )


register_method(Loki())


# ------------------------------------------------------------------------------------- analyze plan
LOKI_VARIANCE_TOP_K = 0.25  # loki-variance: the share of each query's context kept (Loki's main setting)
TOP_K_BUDGETS = (1 / 32, 1 / 16, 0.09375, 0.125, 0.1875, 0.25, 0.375, 0.5)  # the share of each query's context kept
VARIANCE_BUDGETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99)  # the key variance the scores keep


@torch.no_grad()
def loki_proxy(ctx: PlanContext, budgets: tuple[float, ...]) -> list[list[float]]:
    """Half the head dim scoring keys: each layer's attention mass outside each query's top-k keys, mean over
    heads."""
    attentions = ctx.attentions()
    outside = [torch.zeros(len(budgets), dtype=torch.float64) for _ in attentions]
    inputs = captured_inputs(ctx.model, attentions, ctx.windows[:PROXY_WINDOWS])
    for layer, (attention, hidden) in enumerate(zip(attentions, inputs, strict=True)):
        for window in hidden:
            _, _, probabilities, sliding = layer_attention(ctx, layer, attention, window)
            outside[layer] += 1 - top_mass(probabilities, budgets, window=sliding).double().mean(0)
    return [[float(o[i]) / len(inputs[0]) for o in outside] for i in range(len(budgets))]


@torch.no_grad()
def loki_variance_proxy(ctx: PlanContext, budgets: tuple[float, ...]) -> list[list[float]]:
    """Per-layer scoring ranks (``--variance``), each query keeping a quarter of its context: each layer's
    attention mass the keys its rank-r scores select miss against the truly strongest quarter (0 at full rank,
    where the scores are exact)."""
    attentions = ctx.attentions()
    groups = ctx.anatomy.num_heads // ctx.anatomy.num_kv_heads
    length = ctx.windows.shape[1]
    inputs = captured_inputs(ctx.model, attentions, ctx.windows[:PROXY_WINDOWS])
    errors = [[0.0] * len(attentions) for _ in budgets]
    for layer, (attention, hidden) in enumerate(zip(attentions, inputs, strict=True)):
        inv_freq = layer_inv_freq(ctx.model.get_submodule(ctx.family.rotary_path), ctx.model.config, layer)
        bases, energies = key_bases(attention, ctx.stats[layer][0], ctx.anatomy.num_kv_heads, inv_freq, length, "post-rope")
        ranks = [rank_for_variance(energies, variance) for variance in budgets]
        basis = bases.float().repeat_interleave(groups, dim=0)  # [heads, d, d]
        for window in hidden:
            query, key, probabilities, sliding = layer_attention(ctx, layer, attention, window)
            best = top_mass(probabilities, (LOKI_VARIANCE_TOP_K,), scores=probabilities,  # the current token kept alike
                            window=sliding).double().mean()
            query, key = query @ basis, key @ basis  # principal coordinates, strongest first
            for row, rank in zip(errors, ranks, strict=True):
                scores = query[..., :rank] @ key[..., :rank].transpose(-1, -2)
                kept = top_mass(probabilities, (LOKI_VARIANCE_TOP_K,), scores=scores, window=sliding)
                row[layer] += float(best - kept.double().mean()) / len(hidden)
    return errors


def loki_settings(budget: float, anatomy: AttentionAnatomy) -> LokiSettings:
    return LokiSettings(rank=anatomy.head_dim // 2, top_k=budget)


def loki_variance_settings(budget: float, anatomy: AttentionAnatomy) -> LokiSettings:
    return LokiSettings(variance=budget, top_k=LOKI_VARIANCE_TOP_K)


register_planned(PlannedMethod(NAME, TOP_K_BUDGETS, (1 / 16, 0.25), loki_settings, loki_proxy),
                 PlannedMethod(f"{NAME}-variance", VARIANCE_BUDGETS, (0.6, 0.9), loki_variance_settings,
                               loki_variance_proxy, floor_budget=1.0))
