"""SVD-LLM (Wang et al. 2024, "SVD-LLM: Truncation-aware SVD for LLM compression", sec. 3.1, eq. 4-6).

Whitening with the Cholesky factor S of the input second moment X^T X makes the truncation error of
W S equal the output error ||(W - W') X||_F, so dropping the smallest singular values of W S is optimal
for the calibration data. Computed in float64, with damping for singular covariances.
"""

from __future__ import annotations

import torch

from attnsurg.calibrate import InputStatistics
from attnsurg.linalg import cholesky_whitening

NAME = "svdllm"
SUMMARY = "truncation-aware SVD whitened by the Cholesky factor of X^T X (Wang et al. 2024)"


def input_metric(stats: InputStatistics) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, S^-1) with S S^T = E[x x^T] (damped), S lower triangular."""
    S = cholesky_whitening(stats.sigma[:-1, :-1])
    eye = torch.eye(S.shape[0], dtype=S.dtype)
    return S, torch.linalg.solve_triangular(S, eye, upper=False)
