"""CP decomposition of a heads x head_dim x hidden weight tensor (CP-ALS via tensorly).

T ~ sum_r A[:, r] o B[:, r] o C[:, r]: every head shares the projection C (hidden -> R) and the map B
(R -> head_dim) and differs only by its mixing vector A[h] (collaborative attention, Cordonnier et al.
2020). The hidden mode is first reduced to its column space (at most heads x head_dim wide) by an exact
orthogonal projection, which makes ALS cheaper without changing the fit. ALS itself runs in float32.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import tensorly as tl
import torch
from tensorly.decomposition import parafac

from attnsurg.errors import UserError

NAME = "cp"
TOLERANCE = 1e-5  # stop when the relative error changes by less than this between iterations
SUMMARY = "CP-decomposed per-head weights: a shared projection with per-head mixing vectors (collaborative)"


@dataclass
class Fit:
    factors: tuple  # (heads [H, R], dim [d, R], hidden [D, R], None)
    relative_error: float
    converged: bool


def parameters(shape: tuple[int, int, int], ranks: tuple[int, ...]) -> int:
    return ranks[0] * sum(shape)


def flops(shape: tuple[int, int, int], ranks: tuple[int, ...]) -> int:
    """Per token: hidden -> R once, the mixing vector per head, R -> head_dim per head."""
    H, d, D = shape
    return 2 * ranks[0] * (D + H + H * d)


def max_rank(shape: tuple[int, int, int]) -> int:
    return max(shape)


def check_ranks(shape: tuple[int, int, int], ranks: tuple[int, ...], label: str) -> None:
    if len(ranks) != 1 or not 1 <= ranks[0] <= max_rank(shape):
        raise UserError(
            f"--rank {','.join(map(str, ranks))} does not fit {label}: give one CP rank from 1 to "
            f"{max_rank(shape)} (the largest mode size of {','.join(map(str, shape))})"
        )


def ranks_for_budget(shape: tuple[int, int, int], budget: int) -> tuple[int] | None:
    rank = budget // sum(shape)
    return None if rank * sum(shape) >= shape[0] * shape[1] * shape[2] else (rank,)


def decompose(T: torch.Tensor, ranks: tuple[int, ...], max_iterations: int, tolerance: float, seed: int) -> Fit:
    """CP-ALS from an SVD start on the hidden-reduced tensor; stops when the error changes by less than
    ``tolerance``."""
    H, d, D = T.shape
    basis = torch.linalg.svd(T.reshape(H * d, D).T, full_matrices=False)[0]  # [D, min(D, H d)]
    reduced = (T @ basis).float()  # ALS in float32 (3x faster on CPU); the SVD start and the basis in float64
    with tl.backend_context("pytorch"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Trying to compute SVD")  # ranks above a mode size: clipped
        (weights, factors), errors = parafac(
            reduced, rank=ranks[0], n_iter_max=max_iterations, init="svd", tol=tolerance,
            random_state=seed, return_errors=True, normalize_factors=False,
        )
    heads, dim, hidden = (factors[0] * weights).double(), factors[1].double(), basis @ factors[2].double()
    rebuilt = torch.einsum("hr,dr,kr->hdk", heads, dim, hidden)
    error = float((T - rebuilt).norm() / T.norm().clamp_min(1e-300))
    return Fit((heads, dim, hidden, None), error, len(errors) < max_iterations)
