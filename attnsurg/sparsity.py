"""How concentrated attention is: the mass in each query's strongest keys, and the mass on the first token
(the attention sink, Xiao et al. 2023)."""

from __future__ import annotations

import torch

from attnsurg.calibrate import visible_keys

TOP_SHARES = (0.01, 0.05, 0.1)
MIN_CONTEXT = 16  # queries that see fewer keys say little about sparsity (their top 1% is one key)


def context_sizes(length: int, window: int | None, device=None) -> torch.Tensor:
    """How many keys each of L queries sees."""
    context = torch.arange(1, length + 1, device=device)
    return context if window is None else context.clamp(max=window)


def top_mass(probabilities: torch.Tensor, shares: tuple[float, ...] = TOP_SHARES, min_context: int = MIN_CONTEXT,
             scores: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """[heads, shares]: per head, the mean over queries (those seeing at least ``min_context`` keys) of the
    attention mass in the ceil(share x context) strongest keys of each query (one sort for every share); on a
    sliding layer the context is the ``window``.

    With ``scores`` ([..., L, L], e.g. a cheaper scorer's q . k), the keys kept are the ones those scores rank
    highest among the visible ones, the current token always among them (as Loki keeps it), instead of the
    truly strongest."""
    length = probabilities.shape[-1]
    context = context_sizes(length, window, probabilities.device)
    if scores is None:
        cumulative = probabilities.sort(dim=-1, descending=True).values.cumsum(-1)
    else:
        ranking = scores.float().masked_fill(~visible_keys(length, window, scores.device), float("-inf"))
        ranking.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
        cumulative = probabilities.gather(-1, ranking.argsort(dim=-1, descending=True)).cumsum(-1)
    rows = torch.arange(1, length + 1, device=probabilities.device) >= min(min_context, length)
    masses = []
    for share in shares:
        counts = torch.ceil(context.double() * share).long().clamp(1, length)
        kept = cumulative.gather(-1, (counts - 1).expand(*probabilities.shape[:-1]).unsqueeze(-1)).squeeze(-1)
        masses.append(kept[..., rows].mean(-1))
    return torch.stack(masses, dim=-1)


def sink_mass(probabilities: torch.Tensor, min_context: int = MIN_CONTEXT) -> torch.Tensor:
    """Per head, the mean attention mass on the first token (queries seeing at least ``min_context`` keys; on a
    sliding layer those past the window see it no more and count 0)."""
    length = probabilities.shape[-1]
    rows = torch.arange(1, length + 1, device=probabilities.device) >= min(min_context, length)
    return probabilities[..., rows, 0].mean(-1)


def entropy_ratio(probabilities: torch.Tensor, min_context: int = MIN_CONTEXT, window: int | None = None) -> torch.Tensor:
    """Per head, the mean attention entropy over log(context): 1 is uniform over the context (the window, on a
    sliding layer), 0 one key."""
    length = probabilities.shape[-1]
    context = context_sizes(length, window, probabilities.device).double()
    entropy = -(probabilities.double() * probabilities.double().clamp_min(1e-30).log()).sum(-1)
    rows = (torch.arange(1, length + 1, device=probabilities.device) >= min(min_context, length)) & (context >= 2)
    return (entropy[..., rows] / context[rows].log()).mean(-1)
