"""Plain truncated SVD: the input metric is the identity, so the truncation ignores the data.

Kept as the baseline every activation-aware method is measured against (it is ruinous on k/v of real
models: the largest weight directions are not the ones activations excite).
"""

from __future__ import annotations

import torch

from attnsurg.calibrate import InputStatistics

NAME = "svd"
SUMMARY = "plain truncated SVD of each projection (data-free baseline)"


def input_metric(stats: InputStatistics) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, R^-1) with the truncation minimizing ||(W - W') R||_F: here R = I."""
    eye = torch.eye(stats.sigma.shape[0] - 1, dtype=torch.float64)
    return eye, eye
