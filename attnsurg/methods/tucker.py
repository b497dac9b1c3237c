"""Tucker decomposition of a heads x head_dim x hidden weight tensor (Tucker 1966; HOOI via tensorly).

T ~ G x_1 A x_2 B x_3 C with A (heads x R1), B (head_dim x R2), C (hidden x R3) and core G: the hidden
factor C is one basis shared by all heads, so x C is computed once per token for every head
(hidden x R3 multiply-adds instead of heads x head_dim x hidden), then each head maps R3 -> R2 through its
slice of the core and R2 -> head_dim through the shared B.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import tensorly as tl
import torch
from tensorly.decomposition import tucker

from attnsurg.errors import UserError

NAME = "tucker"
TOLERANCE = 1e-6  # stop when the relative error changes by less than this between iterations
SUMMARY = "Tucker-decomposed per-head weights with shared bases, whitened by the calibration inputs"
DIM_FRACTIONS = (1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25)


@dataclass
class Fit:
    factors: tuple  # (heads [H, R1], dim [d, R2], hidden [D, R3], core [R1, R2, R3])
    relative_error: float
    converged: bool


def max_ranks(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """The largest multilinear rank each mode can have: min(mode size, product of the others)."""
    H, d, D = shape
    return min(H, d * D), min(d, H * D), min(D, H * d)


def parameters(shape: tuple[int, int, int], ranks: tuple[int, ...]) -> int:
    (H, d, D), (r1, r2, r3) = shape, ranks
    return H * r1 + d * r2 + D * r3 + r1 * r2 * r3


def flops(shape: tuple[int, int, int], ranks: tuple[int, ...]) -> int:
    """Per token: hidden -> R3 once, R3 -> R2 per head (its core slice), R2 -> head_dim per head."""
    (H, d, D), (_, r2, r3) = shape, ranks
    return 2 * (D * r3 + H * r2 * r3 + H * d * r2)


def check_ranks(shape: tuple[int, int, int], ranks: tuple[int, ...], label: str) -> None:
    limits = max_ranks(shape)
    if len(ranks) != 3 or any(not 1 <= r <= m for r, m in zip(ranks, limits)):
        raise UserError(
            f"--ranks {','.join(map(str, ranks))} does not fit {label}: give 3 ranks (heads, head_dim, hidden), "
            f"each from 1 to {','.join(map(str, limits))} (mode sizes {','.join(map(str, shape))})"
        )


def hidden_rank_for(shape: tuple[int, int, int], r1: int, r2: int, budget: int) -> int:
    H, d, D = shape
    return (budget - H * r1 - d * r2) // (D + r1 * r2)


def ranks_for_budget(shape: tuple[int, int, int], budget: int) -> tuple[int, int, int] | None:
    """Uniform default before calibration: all heads, full head_dim, the hidden rank the budget allows."""
    H, d, _ = shape
    r3 = hidden_rank_for(shape, H, d, budget)
    return None if r3 >= max_ranks(shape)[2] else (H, d, r3)


def best_ranks_for_budget(T: torch.Tensor, budget: int) -> tuple[int, int, int] | None:
    """Among splits of the budget between the head_dim and hidden modes (all heads kept), the one with the
    smallest truncated-HOSVD error of the (whitened) tensor: ||T||^2 - ||T x_2 U_2^T x_3 U_3^T||^2."""
    return BudgetSplits(T).best(budget)[0]


class BudgetSplits:
    """A tensor's mode-2 and mode-3 singular bases, computed once, and for any parameter budget the split
    between head_dim and hidden ranks with the smallest truncated-HOSVD error."""

    def __init__(self, T: torch.Tensor):
        self.T, self.shape = T, tuple(T.shape)
        d, D = self.shape[1], self.shape[2]
        self.U2 = torch.linalg.svd(T.permute(1, 0, 2).reshape(d, -1), full_matrices=False)[0]
        self.U3 = torch.linalg.svd(T.permute(2, 0, 1).reshape(D, -1), full_matrices=False)[0]
        self.total = T.pow(2).sum()

    def best(self, budget: int) -> tuple[tuple[int, int, int] | None, float]:
        """The best split's ranks (None: the budget affords the full ranks, the projection stays dense) and its
        squared error relative to ||T||^2."""
        H, _, _ = self.shape
        limits = max_ranks(self.shape)
        best, best_error = None, float("inf")
        for fraction in DIM_FRACTIONS:
            r2 = max(1, round(fraction * limits[1]))
            r3 = min(hidden_rank_for(self.shape, H, r2, budget), limits[2])
            if r3 < 1:
                continue
            if r2 == limits[1] and r3 == limits[2]:
                return None, 0.0
            core = torch.einsum("hdk,ds,kt->hst", self.T, self.U2[:, :r2], self.U3[:, :r3])
            error = float(self.total - core.pow(2).sum())
            if error < best_error:
                best, best_error = (H, r2, r3), error
        return best, best_error / float(self.total.clamp_min(1e-300))


def decompose(T: torch.Tensor, ranks: tuple[int, ...], max_iterations: int, tolerance: float, seed: int) -> Fit:
    """HOOI from the truncated HOSVD; stops when the error changes by less than ``tolerance``."""
    with tl.backend_context("pytorch"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Trying to compute SVD")  # ranks above a mode size: clipped
        (core, factors), errors = tucker(
            T, rank=list(ranks), n_iter_max=max_iterations, init="svd", tol=tolerance,
            random_state=seed, return_errors=True,
        )
    rebuilt = torch.einsum("abc,ha,db,kc->hdk", core, *factors)
    error = float((T - rebuilt).norm() / T.norm().clamp_min(1e-300))
    return Fit((factors[0], factors[1], factors[2], core), error, len(errors) < max_iterations)
