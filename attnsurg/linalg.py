"""Small float64 linear-algebra helpers shared by the surgery methods."""

from __future__ import annotations

import math

import torch


def augmented(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[W b] in float64, so W x + b = [W b] [x; 1]."""
    column = torch.zeros(weight.shape[0], 1, dtype=torch.float64) if bias is None else bias.double()[:, None]
    return torch.cat([weight.double(), column], dim=1)


def sqrt_and_inverse_sqrt(S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric S^1/2 and S^-1/2 of a PSD matrix, eigenvalues floored at 1e-10 of the largest."""
    eigenvalues, eigenvectors = torch.linalg.eigh(S)
    eigenvalues = eigenvalues.clamp_min(eigenvalues.max() * 1e-10)
    root = eigenvectors * eigenvalues.sqrt()
    return root @ eigenvectors.T, (eigenvectors / eigenvalues.sqrt()) @ eigenvectors.T


def rescaled(S: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """Scale a consumer weight so the weighted energy tr(S C) equals the plain energy tr(C)."""
    return S * (torch.trace(C) / torch.trace(S @ C).clamp_min(1e-30))


def cholesky_whitening(sigma: torch.Tensor, damping: float = 1e-6) -> torch.Tensor:
    """Lower-triangular S with S S^T = sigma + lambda I (SVD-LLM's whitening, float64).

    lambda starts at ``damping`` times the mean diagonal and grows tenfold until the factorization
    succeeds, so a singular or ill-conditioned calibration covariance (dead channels, too few tokens)
    still yields a whitening; the truncation is then exact in every direction the data never visits.
    """
    sigma = sigma.double()
    scale = sigma.diagonal().mean().clamp_min(1e-30)
    eye = torch.eye(sigma.shape[0], dtype=sigma.dtype, device=sigma.device)
    for exponent in range(12):
        factor, info = torch.linalg.cholesky_ex(sigma + eye * scale * damping * 10**exponent)
        if info == 0:
            return factor
    raise ValueError("calibration covariance could not be factorized even with heavy damping")


def orthogonal_gaussian(features: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of blocks of orthogonal directions with chi-distributed norms (Performer's ORF, Choromanski et al.
    2021, sec. 4.2): unbiased like i.i.d. Gaussian features, with lower variance."""
    blocks = []
    for _ in range(math.ceil(features / dim)):
        square = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        blocks.append(torch.linalg.qr(square).Q.T)
    directions = torch.cat(blocks)[:features]
    norms = torch.randn(features, dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return directions * norms[:, None]
