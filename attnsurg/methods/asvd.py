"""ASVD (Yuan et al. 2023, "ASVD: Activation-aware Singular Value Decomposition", sec. 3.2).

Input channels are scaled by their mean activation magnitude before the SVD, S = diag(E|x_j|^alpha) with
alpha = 0.5, so channels that carry large activations (outliers) are kept more faithfully; the factors are
mapped back with S^-1.
"""

from __future__ import annotations

import torch

from attnsurg.calibrate import InputStatistics

NAME = "asvd"
SUMMARY = "activation-scaled SVD: input channels scaled by mean |x|^0.5 (Yuan et al. 2023)"
ALPHA = 0.5


def input_metric(stats: InputStatistics) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, R^-1) with R = diag(E|x|^alpha), floored so dead channels stay invertible."""
    scale = stats.abs_mean.pow(ALPHA)
    scale = scale.clamp_min(scale.max() * 1e-6)
    return torch.diag(scale), torch.diag(1 / scale)
