"""The metric a head tensor is decomposed under, and the way back: ``compress --method tucker|cp`` whitens
each projection's per-head tensor by its input and consumer statistics (``whiten``), decomposes the whitened
tensor, maps the factors back (``module_state``) and refits the hidden factor under the exact metric
(``refit_hidden_factor``). The math is in ``methods/headtensor.py``'s docstring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnsurg.calibrate import InputStatistics
from attnsurg.linalg import cholesky_whitening
from attnsurg.methods.consumers import LayerContext

if TYPE_CHECKING:
    from attnsurg.methods.headtensor import HeadTensorPlan, HeadUnit


@dataclass
class Whitened:
    """T' and what maps the decomposed factors of T' back to factors of T."""

    tensor: torch.Tensor  # [heads, head_dim, hidden], float64
    unwhiten_heads: torch.Tensor  # [heads]: divide the head factor's rows by these
    unwhiten_dim: torch.Tensor | None  # [head_dim, head_dim]: dim factor <- M @ dim factor (o only)
    unwhiten_hidden: torch.Tensor | None  # [hidden, hidden]: hidden factor <- M @ hidden factor (q/k/v)


def head_tensor(unit: HeadUnit, weight: torch.Tensor) -> torch.Tensor:
    W = weight.detach().double()
    if unit.heads_on == "output":
        return W.view(unit.heads, unit.head_dim, unit.hidden)
    return W.view(unit.hidden, unit.heads, unit.head_dim).permute(1, 2, 0).contiguous()


def shared_metric(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For per-head d x d metrics M_h: the closest metric that keeps a head-dim factor shared across heads,
    one factor L with L L^T = mean_h M_h and per-head scales s_h = sqrt(tr M_h / tr mean_h M_h)."""
    mean = blocks.mean(0)
    scale = (blocks.diagonal(dim1=1, dim2=2).sum(-1) / mean.trace().clamp_min(1e-30)).clamp_min(1e-12).sqrt()
    return cholesky_whitening(mean), scale


def diagonal_blocks(M: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    return torch.stack([M[h * d : (h + 1) * d, h * d : (h + 1) * d] for h in range(heads)])


def whiten(unit: HeadUnit, weight: torch.Tensor, stats: InputStatistics, consumer: torch.Tensor | None = None) -> Whitened:
    """T' with the input metric (and, for q/k/v, the shared form of the consumer weight ``consumer``,
    per-head d x d blocks) applied, and the maps that undo it on the factors."""
    T = head_tensor(unit, weight)
    sigma = stats.sigma[:-1, :-1]
    if unit.heads_on == "output":
        S = cholesky_whitening(sigma)
        T, unwhiten_hidden = T @ S, torch.linalg.inv(S).T
        if consumer is None:
            return Whitened(T, torch.ones(unit.heads, dtype=torch.float64), None, unwhiten_hidden)
        L, scale = shared_metric(consumer)
        return Whitened(scale[:, None, None] * torch.einsum("ij,hjk->hik", L.T, T), scale, torch.linalg.inv(L).T, unwhiten_hidden)
    L, scale = shared_metric(diagonal_blocks(sigma, unit.heads, unit.head_dim))
    return Whitened(scale[:, None, None] * torch.einsum("ij,hjk->hik", L.T, T), scale, torch.linalg.inv(L).T, None)


def consumer_blocks(unit: HeadUnit, ctx: LayerContext) -> torch.Tensor | None:
    """Per-head d x d blocks of what consumes a q/k/v head's output (see lowrank.py); None for o."""
    weight = {"q": ctx.query_weight, "k": ctx.key_weight, "v": ctx.value_weight}.get(unit.name)
    return None if weight is None else diagonal_blocks(weight(), unit.heads, unit.head_dim)


def module_state(plan: HeadTensorPlan, factors, w: Whitened, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The replacing module's tensors from the factors of T' (heads, dim, hidden[, core])."""
    heads, dim, hidden, core = factors
    heads = heads / w.unwhiten_heads[:, None]
    if w.unwhiten_dim is not None:
        dim = w.unwhiten_dim @ dim
    if w.unwhiten_hidden is not None:
        hidden = w.unwhiten_hidden @ hidden
    state = {"factor_heads": heads, "factor_dim": dim, "factor_hidden": hidden}
    if core is not None:
        state["core"] = core
    if bias is not None:
        state["bias"] = bias.detach()
    return state


def head_maps(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """K [heads * head_dim, R_hidden]: row block h is B (A[h] x_1 G), what head h applies to the hidden
    coordinates (Tucker), or B diag(A[h]) (CP)."""
    heads, dim = state["factor_heads"], state["factor_dim"]
    mix = torch.einsum("hr,rst->hst", heads, state["core"]) if "core" in state else torch.diag_embed(heads)
    return torch.einsum("ds,hst->hdt", dim, mix).flatten(0, 1)


def refit_hidden_factor(unit: HeadUnit, state: dict, weight: torch.Tensor, x: InputStatistics, consumer) -> None:
    """Given the head factors, the hidden factor has a closed-form optimum under the *exact* metric, which the
    shared-across-heads metric of the decomposition only approximates (weighted least squares, float64):

    - q/k/v, W ~ K C^T: C^T = (K^T Omega K)^-1 K^T Omega W with Omega the per-head consumer blocks (or I);
      the input metric cancels since C^T is free in every input direction;
    - o, W_o ~ C K^T: C = W_o Sigma K (K^T Sigma K)^-1 with the full input covariance Sigma, cross-head
      correlations included."""
    K = head_maps(state)
    W = weight.detach().double()
    eye = torch.eye(K.shape[1], dtype=torch.float64)
    if unit.heads_on == "output":
        omega = torch.eye(K.shape[0], dtype=torch.float64) if consumer is None else torch.block_diag(*consumer)
        gram = K.T @ omega @ K
        hidden_t = torch.linalg.solve(gram + eye * gram.diagonal().mean() * 1e-10, K.T @ omega @ W)
        state["factor_hidden"] = hidden_t.T.contiguous()
    else:
        sigma = x.sigma[:-1, :-1]
        gram = K.T @ sigma @ K
        state["factor_hidden"] = torch.linalg.solve(gram + eye * gram.diagonal().mean() * 1e-10, (W @ sigma @ K).T).T.contiguous()
