"""Singular-value spectra and how much of them a rank keeps.

A spectrum is kept as singular values, strongest first; the energy a rank r keeps is
sum_{i<r} s_i^2 / sum_i s_i^2 (Eckart-Young: the share of ||X||_F^2 the best rank-r approximation holds).
Activation spectra come from second moments: the eigenvalues of E[x x^T] are the squared singular values of
the token matrix divided by the token count, so ranks and energy shares are the same."""

from __future__ import annotations

import torch

ENERGY_SHARES = (0.9, 0.99)


def energy_rank(values: torch.Tensor, share: float) -> int:
    """The smallest r whose r strongest singular values hold ``share`` of the energy (0 for a zero spectrum)."""
    energy = values.double().pow(2)
    total = energy.sum()
    if total <= 0:
        return 0
    kept = energy.cumsum(0) / total
    return min(int(torch.searchsorted(kept, torch.tensor(share, dtype=kept.dtype)).item()) + 1, len(values))


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    """Singular values of a weight matrix, in float64, strongest first."""
    return torch.linalg.svdvals(matrix.detach().double().cpu())


def moment_spectrum(moment: torch.Tensor) -> torch.Tensor:
    """Root-mean-square singular values of the tokens behind a second moment E[x x^T], strongest first."""
    eigenvalues = torch.linalg.eigvalsh(moment.double()).flip(0)
    return eigenvalues.clamp_min(0).sqrt()


def frequency_energy(moment: torch.Tensor) -> torch.Tensor:
    """E[x_i^2 + x_{i+d/2}^2] per RoPE frequency i of a head's second moment ([d, d], half-split layout: dims i
    and i + d/2 rotate together). RoPE rotates each pair, so the energy per frequency is the same before and
    after it; it says which frequencies carry the keys (what an MLA RoPE split keeps)."""
    diagonal = moment.diagonal().double()
    half = diagonal.shape[0] // 2
    return diagonal[:half] + diagonal[half:]


def head_rows(weight: torch.Tensor, head: int, rows_per_head: int) -> torch.Tensor:
    """The rows of a projection that produce one head (or one KV group's query heads)."""
    return weight[head * rows_per_head : (head + 1) * rows_per_head]
