"""``--allocate``: the ranks of a low-rank compression spread over its units by their spectra, at the uniform
ranks' total cost (``compress --method svd|asvd|svdllm --allocate``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnsurg.methods.lowrank import Unit

ALLOCATION_FLOOR = 0.75


def allocate_ranks(units: list[Unit], spectra: list[torch.Tensor], budget: int, floors: list[int]) -> list[int]:
    """Greedy water-filling: every unit starts at its floor rank, then singular directions are taken in order
    of relative energy per unit of cost until the budget (in cost units) is spent. Ranks stay below the
    break-even rank (latents: the full rank)."""
    ranks = list(floors)
    remaining = budget - sum(r * u.rank_cost for r, u in zip(floors, units))
    gains, owners, costs = [], [], []
    for i, (unit, s) in enumerate(zip(units, spectra)):
        cap = min(len(s), unit.full_rank if unit.name == "kv" else max(1, unit.break_even - 1))
        energy = s.pow(2) / s.pow(2).sum().clamp_min(1e-300)
        candidates = energy[floors[i] : cap]
        gains.append(candidates / unit.rank_cost)
        owners.append(torch.full((len(candidates),), i))
        costs.append(torch.full((len(candidates),), unit.rank_cost))
    gains, owners, costs = torch.cat(gains), torch.cat(owners), torch.cat(costs)
    order = gains.argsort(descending=True)
    taken = order[costs[order].cumsum(0) <= remaining]
    for i in owners[taken].tolist():
        ranks[i] += 1
    return ranks


def allocated_ranks(units: list[Unit], spectra: list[torch.Tensor], uniform: list[int | None]) -> list[int]:
    """``--allocate``: the uniform ranks' total cost (parameters; cached values for latents) spread over the
    units by their spectra."""
    budget = sum(u.params(r) if u.name != "kv" else r for u, r in zip(units, uniform))
    return allocate_ranks(units, spectra, budget, allocation_floors(units, uniform))


def allocation_floors(units: list[Unit], uniform: list[int | None]) -> list[int]:
    """No unit below ALLOCATION_FLOOR of its uniform rank: relative energy does not see how much the loss
    depends on each layer, and starving a few layers entirely was measured to cost more than it saves."""
    return [max(1, int(ALLOCATION_FLOOR * (r if r is not None else u.break_even))) for u, r in zip(units, uniform)]
