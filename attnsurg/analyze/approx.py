"""The survey's attention approximations, measured on a model's own Q, K, V: each family's attention output
against exact causal attention, at equal budgets.

A budget b is the share of exact attention's cost the approximation spends: rank b L of the attention matrix,
b L Nystrom landmarks, b L random features, buckets of about b L keys (1 / b buckets), the b x context
strongest keys. The error is ||O~ - O||_F / ||O||_F per head, O = softmax(Q K^T s + causal mask) V.
Every family runs in float64 on one window of one head at a time: this is an instrument, not a kernel. The
reference is plain causal softmax attention of the layer's queries and keys: a sliding layer's window and Gemma
2's soft-cap are not applied (the families approximate that attention, not the layer's variant of it)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attnsurg.heads import attention_probabilities
from attnsurg.calibrate import visible_keys
from attnsurg.linalg import orthogonal_gaussian

BUDGETS = (1 / 16, 1 / 8, 1 / 4)
LSH_ROUNDS = 2  # hash rounds whose buckets a query may attend in (Reformer, sec. 3)
LOKI_RANK_SHARE = 1 / 4  # Loki scores keys with this share of the head dim


def exact_attention(q, k, v, scale) -> torch.Tensor:
    return attention_probabilities(q, k, scale) @ v


def low_rank(q, k, v, scale, budget: float, generator=None) -> torch.Tensor:
    """The best rank-r approximation of the attention matrix (Eckart-Young; the bound Linformer-style
    projections aim at), r = budget x L."""
    probabilities = attention_probabilities(q, k, scale)
    rank = max(1, round(budget * len(q)))
    u, s, vh = torch.linalg.svd(probabilities)
    return (u[:, :rank] * s[:rank]) @ (vh[:rank] @ v)


def segment_means(x: torch.Tensor, count: int) -> torch.Tensor:
    return torch.stack([part.mean(0) for part in torch.tensor_split(x, count)])


def iterative_pinv(a: torch.Tensor, iterations: int = 6) -> torch.Tensor:
    """The Moore-Penrose inverse as Nystromformer approximates it (Xiong et al. 2021, eq. 16, after Razavi et
    al. 2014), from Z0 = A^T / (||A||_1 ||A||_inf). Six iterations, as the paper uses, also regularise: the
    exact pseudo-inverse of the landmark kernel is ill-conditioned on real attention and blows the error up."""
    eye = torch.eye(a.shape[0], dtype=a.dtype)
    z = a.T / (a.abs().sum(0).max() * a.abs().sum(1).max())
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom(q, k, v, scale, budget: float, generator=None, iterations: int | None = 6) -> torch.Tensor:
    """Nystromformer (Xiong et al. 2021, eq. 14) with m = budget x L landmarks (segment means of Q and K):
    softmax(Q K~^T) Z softmax(Q~ K^T) V, Z the iterative pseudo-inverse of softmax(Q~ K~^T) (``iterations``
    None: the exact one). Nystrom has no causal form (masking its matrix leaves rows that sum to about zero),
    so it is measured bidirectionally, against exact bidirectional attention (``BIDIRECTIONAL``)."""
    landmarks = max(1, round(budget * len(q)))
    q_l, k_l = segment_means(q, landmarks), segment_means(k, landmarks)
    kernel = torch.softmax((q @ k_l.T) * scale, -1)
    landmark_kernel = torch.softmax((q_l @ k_l.T) * scale, -1)
    core = torch.linalg.pinv(landmark_kernel) if iterations is None else iterative_pinv(landmark_kernel, iterations)
    right = torch.softmax((q_l @ k.T) * scale, -1)
    return kernel @ (core @ (right @ v))


def bidirectional_attention(q, k, v, scale) -> torch.Tensor:
    return torch.softmax((q @ k.T) * scale, -1) @ v


def performer(q, k, v, scale, budget: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """FAVOR+ (Choromanski et al. 2021, Lemma 1): exp(q.k s) = E[phi(q') phi(k')] with positive features
    phi(x) = exp(w x - |x|^2 / 2) / sqrt(m) of m = budget x L orthogonal random w, x' = x s^(1/2); causal by
    prefix sums over the keys."""
    generator = generator or torch.Generator().manual_seed(0)
    features = max(1, round(budget * len(q)))
    w = orthogonal_gaussian(features, q.shape[-1], generator)
    root = math.sqrt(scale)

    def exponent(x: torch.Tensor) -> torch.Tensor:  # log of phi, up to the 1/sqrt(m) that cancels
        return (x * root) @ w.T - (x * root).pow(2).sum(-1, keepdim=True) / 2

    q_exponent, k_exponent = exponent(q), exponent(k)
    q_features = torch.exp(q_exponent - q_exponent.amax(-1, keepdim=True))  # a per-query shift cancels in its row
    k_features = torch.exp(k_exponent - k_exponent.amax())  # one shift for every key cancels too
    numerator = torch.einsum("lm,lmd->ld", q_features, torch.einsum("lm,ld->lmd", k_features, v).cumsum(0))
    denominator = (q_features * k_features.cumsum(0)).sum(-1, keepdim=True)
    return numerator / denominator


def lsh_buckets(x: torch.Tensor, buckets: int, rotation: torch.Tensor) -> torch.Tensor:
    """Angular LSH (Reformer, sec. 3): argmax over [x R, -x R] of the unit-normalised x."""
    projected = torch.nn.functional.normalize(x, dim=-1) @ rotation
    return torch.cat([projected, -projected], dim=-1).argmax(-1)


def lsh(q, k, v, scale, budget: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Reformer-style bucketing: LSH_ROUNDS / budget angular-LSH buckets per round (rounded up to even), so
    that the union of a query's buckets over the LSH_ROUNDS rounds holds about budget x its context; it
    attends those earlier keys and itself. Queries and keys are hashed by the same rotation (Reformer shares
    them; here they are the model's own Q and K)."""
    generator = generator or torch.Generator().manual_seed(0)
    buckets = max(1, round(LSH_ROUNDS / budget)) if budget < 1 else 1
    allowed = visible_keys(len(q))
    if buckets > 1:
        buckets += buckets % 2
        same = torch.zeros_like(allowed)
        for _ in range(LSH_ROUNDS):
            rotation = torch.randn(q.shape[-1], buckets // 2, generator=generator, dtype=torch.float64)
            same |= lsh_buckets(q, buckets, rotation)[:, None] == lsh_buckets(k, buckets, rotation)[None, :]
        allowed = allowed & (same | torch.eye(len(q), dtype=torch.bool))
    scores = ((q @ k.T) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v


def keep_counts(length: int, budget: float) -> torch.Tensor:
    context = torch.arange(1, length + 1)
    return torch.ceil(context.double() * budget).long().clamp(1).minimum(context)


def attend_top(scores_for_selection: torch.Tensor, q, k, v, scale, budget: float) -> torch.Tensor:
    """Exact attention over each query's budget x context keys ranked best by ``scores_for_selection``."""
    length = len(q)
    ranking = scores_for_selection.masked_fill(~visible_keys(length), float("-inf"))
    keep = keep_counts(length, budget)
    threshold = ranking.sort(-1, descending=True).values.gather(-1, (keep - 1)[:, None])
    scores = ((q @ k.T) * scale).masked_fill((ranking < threshold) | ~visible_keys(length), float("-inf"))
    return torch.softmax(scores, -1) @ v


def top_k(q, k, v, scale, budget: float, generator=None) -> torch.Tensor:
    """The budget x context keys with the highest exact scores (the oracle every top-k method approaches)."""
    return attend_top(q @ k.T, q, k, v, scale, budget)


def loki(q, k, v, scale, budget: float, generator=None) -> torch.Tensor:
    """Loki (Singhania et al. 2024, alg. 1): keys ranked by scores in the first d/4 principal directions of
    this window's keys, exact attention over the budget x context best."""
    rank = max(1, round(q.shape[-1] * LOKI_RANK_SHARE))
    basis = torch.linalg.eigh(k.T @ k).eigenvectors.flip(-1)[:, :rank]
    return attend_top((q @ basis) @ (k @ basis).T, q, k, v, scale, budget)


BIDIRECTIONAL = {"nystrom"}  # families measured against bidirectional attention

FAMILIES: dict[str, Callable] = {
    "low rank": low_rank,
    "nystrom": nystrom,
    "performer": performer,
    "lsh": lsh,
    "top-k": top_k,
    "loki": loki,
}


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm())


def family_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  budgets: tuple[float, ...] = BUDGETS, seed: int = 0) -> dict[str, list[float]]:
    """Per family, the mean over heads of the relative output error at each budget ([H, L, d] inputs, keys
    and values already repeated to the query heads)."""
    q, k, v = q.double(), k.double(), v.double()
    errors = {name: [0.0] * len(budgets) for name in FAMILIES}
    for head in range(q.shape[0]):
        exact = exact_attention(q[head], k[head], v[head], scale)
        bidirectional = bidirectional_attention(q[head], k[head], v[head], scale)
        for name, family in FAMILIES.items():
            reference = bidirectional if name in BIDIRECTIONAL else exact
            for i, budget in enumerate(budgets):
                generator = torch.Generator().manual_seed(seed + head)
                approx = family(q[head], k[head], v[head], scale, budget, generator)
                errors[name][i] += relative_error(approx, reference) / q.shape[0]
    return errors
