"""The closed-form fit of one layer (steps 1-5 of the package docstring), in float64."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from attnsurg.calibrate import InputStatistics
from attnsurg.linalg import augmented, rescaled, sqrt_and_inverse_sqrt
from attnsurg.methods.consumers import norm_scale
from attnsurg.methods.mla.plan import MLAPlan


# Latent-norm constant: a power of two (exact in bfloat16), far above any latent value.
NORM_CONSTANT = 2.0**24
CHANNEL_DOMINANCE = 32.0  # native format: the fitted constant channel's size over the latent's RMS size
# The dominances refinement chooses from, per layer, on the converted model's own stream. A large one neutralises
# the latent RMSNorm best where a . x is near 1, but a token whose a . x falls near 0 then has its latent
# multiplied by up to the dominance: on the demo model at 25% KV with six-domain calibration one such token (a
# drifted attention sink) at layer 4 took wiki-sample ppl to x443,908 at 32 alone (x3.88 at 2 alone).
CHANNEL_DOMINANCES = (32.0, 8.0, 2.0)
# Ridge of the constant channel's regression, relative to the mean input energy. On the demo model 1e-2 fits the
# calibration tokens tighter but extrapolates to the converted model's own stream badly (calibrated on all six
# domains, wiki-sample ppl x170 against x1.30 at 1.0): a large ridge keeps a near the mean direction.
CONSTANT_RIDGE = 1.0
# The ridges refinement chooses from, per layer, on the converted model's own stream. On Qwen2.5-Coder-0.5B the
# ridge of 1.0 leaves a . x at 0.63-0.75 on the second token of a prompt in layers 16 and 20 (0.90 elsewhere),
# which multiplies those tokens' closed-form error by 3-6 (``benchmarks/mla_bias_probe.py``, "@1" columns); at 0.1
# the spread of a . x halves and the native layer errs about as little as the exact one.
CONSTANT_RIDGES = (1.0, 0.1)


# Key distances over which a native-format RoPE key bias keeps its rotation (``rope_bias_shrinkage``): the
# 1024-token windows figures are scored on. Qwen2.5-Coder-0.5B's layer 0 at 0.5, held-out closed-form error:
# spans of 128, 512 and 2048 give 0.085, 0.106 and 0.182; the bias folded whole 0.536, the exact format 0.054.
ROTATION_SPAN = 1024


# ---------------------------------------------------------------------------------------- the fit
@dataclass
class MLAWeights:
    """One converted layer, in float64: DeepseekV3 attention parameters. Widths are for the exact format
    (the latent-norm channel is the + 1); the native format has no norm channel and no biases (None)."""

    q_proj: torch.Tensor  # [H * (qk_nope + R), D]
    q_bias: torch.Tensor | None  # [H * (qk_nope + R)], zero without query biases
    kv_a_weight: torch.Tensor  # [r + 1 + R, D]
    kv_a_bias: torch.Tensor | None  # [r + 1 + R]
    kv_a_norm: torch.Tensor  # [r + 1]
    kv_b_proj: torch.Tensor  # [H * (qk_nope + d), r + 1]
    o_bias: torch.Tensor | None  # [D]


def frequency_rows(head: int, i: int, d: int) -> list[int]:
    """Rows of head ``head`` that RoPE rotates together at frequency i (HF layout: i and i + d/2)."""
    return [head * d + i, head * d + i + d // 2]


def rorope_bases(Wk: torch.Tensor, sigma: torch.Tensor, plan: MLAPlan) -> list[torch.Tensor]:
    """Per frequency group, the orthogonal mix of its members' key 2-vectors (rows = components, strongest
    first; columns = ``plan.group_members``) from the key PCA: G x G without a fold."""
    bases = []
    for i in range(plan.groups):
        members = plan.group_members(i)
        energy = torch.zeros(len(members), len(members), dtype=torch.float64)
        for c in range(2):
            rows = Wk[[frequency_rows(g, f, plan.head_dim)[c] for g, f in members]]
            energy += rows @ sigma @ rows.T
        eigenvalues, eigenvectors = torch.linalg.eigh(energy)
        bases.append(eigenvectors[:, eigenvalues.argsort(descending=True)].T)
    return bases


def split_components(plan: MLAPlan) -> tuple[list, list]:
    """(j, i, c) triples: RoPE keeps components j < counts[i] of frequency group i, pairs in DeepSeek's
    interleaved order (c = 0, 1 adjacent); everything else goes to the no-RoPE key."""
    counts = plan.counts
    rope = [(j, i, c) for i in range(plan.groups) for j in range(counts[i]) for c in range(2)]
    kept = set(rope)
    tiers = plan.num_kv_heads * plan.rope_fold
    nope = [(j, i, c) for j in range(tiers) for i in range(plan.groups) if j < len(plan.group_members(i)) for c in range(2)]
    return rope, [t for t in nope if t not in kept]


def rope_frequencies(plan: MLAPlan, inv_freq: torch.Tensor) -> list[float]:
    """The frequency of each RoPE pair of the converted key, in layout order: each group's first."""
    return [float(inv_freq[plan.group_frequencies(i)[0]]) for i in range(plan.groups) for _ in range(plan.counts[i])]


def query_mixes(bases: list[torch.Tensor], components: list, plan: MLAPlan) -> list[torch.Tensor]:
    """Per KV group g, T_g [len(components), d]: the converted query rows of a head h of group g for these
    (j, i, c) components are T_g W_h, a mix of its own d query rows: row (j, i, c) is U_i[j, (g, f)] times the
    row at frequency f, part c, summed over the frequencies f of group i. So for the no-RoPE part
    q'_h . (B_k c) = q_h . (T_g^T B_k c): the group's no-RoPE key in head coordinates is T_g^T B_k, head_dim
    wide."""
    d = plan.head_dim
    mixes = []
    for g in range(plan.num_kv_heads):
        mix = torch.zeros(len(components), d, dtype=torch.float64)
        for row, (j, i, c) in enumerate(components):
            for column, (head, f) in enumerate(plan.group_members(i)):
                if head == g:
                    mix[row, f + c * (d // 2)] = bases[i][j, column]
        mixes.append(mix)
    return mixes


def latent_factors(M: torch.Tensor, sigma: torch.Tensor, S: torch.Tensor | None, rank: int):
    """Rank-r A, B minimizing E||S^1/2 (z - B A x~)||^2 for z = M x~: weighted PCA of z's second moment."""
    C = M @ sigma @ M.T
    if S is None:
        root = inverse_root = torch.eye(C.shape[0], dtype=C.dtype)
    else:
        root, inverse_root = sqrt_and_inverse_sqrt(S)
    eigenvalues, eigenvectors = torch.linalg.eigh(root @ C @ root)
    top = eigenvectors[:, eigenvalues.argsort(descending=True)[:rank]]
    return top.T @ root @ M, inverse_root @ top  # A: [r, D+1], B: [n, r]


def query_moment(Wq: torch.Tensor, sigma: torch.Tensor, mixes: list[torch.Tensor], plan: MLAPlan) -> torch.Tensor:
    """sum_h Q_h sigma Q_h^T over each head's no-RoPE query rows Q_h = T_g(h) W_h (``query_mixes``): each
    head's moment is taken at head width, T_g (W_h sigma W_h^T) T_g^T, not at the key's (G times wider)."""
    d, H, group = plan.head_dim, plan.num_heads, plan.num_heads // plan.num_kv_heads
    projected = Wq @ sigma
    moment = torch.zeros(mixes[0].shape[0], mixes[0].shape[0], dtype=torch.float64)
    for h in range(H):
        head = slice(h * d, (h + 1) * d)
        mix = mixes[h // group]
        moment += mix @ (projected[head] @ Wq[head].T) @ mix.T
    return moment


def consumer_weight(S_k: torch.Tensor, Wo: torch.Tensor, plan: MLAPlan, C: torch.Tensor) -> torch.Tensor:
    """Block-diagonal weight: the no-RoPE queries' second moment ``S_k`` (``query_moment``) for the no-RoPE key,
    W_o^T W_o per group for values."""
    d, G, H = plan.head_dim, plan.num_kv_heads, plan.num_heads
    n_k = plan.nope_key_dim
    S_v = torch.zeros(G * d, G * d, dtype=torch.float64)
    for h in range(H):
        g = h // (H // G)
        Wo_h = Wo[:, h * d : (h + 1) * d].double()
        S_v[g * d : (g + 1) * d, g * d : (g + 1) * d] += Wo_h.T @ Wo_h
    S = torch.zeros(C.shape, dtype=torch.float64)
    S[:n_k, :n_k] = rescaled(S_k, C[:n_k, :n_k])
    S[n_k:, n_k:] = rescaled(S_v, C[n_k:, n_k:])
    return S + torch.eye(S.shape[0], dtype=S.dtype) * S.diagonal().mean() * 1e-6


def linearised_norm(W: torch.Tensor, attn, projection: str, sigma: torch.Tensor, heads: int) -> torch.Tensor:
    """The query or key map with a per-head RMSNorm after it (Qwen3's q_norm/k_norm, n(y) = g * y / rms(y))
    replaced by its linearisation at each head's mean square E[rms(y)^2] = tr(W_h sigma W_h^T) / d: MLA's
    shared latent has no per-token, per-head normalisation, so the closed form fits this linear surrogate and
    refinement fits the rest against the real layer (with the norms) on calibration data."""
    gain = norm_scale(attn, projection)
    if gain is None:
        return W
    d = W.shape[0] // heads
    rows = []
    for h in range(heads):
        Wh = W[h * d : (h + 1) * d]
        rows.append(gain[:, None] * Wh / (((Wh @ sigma) * Wh).sum() / d).sqrt())
    return torch.cat(rows)


def query_projection(Wq: torch.Tensor, maps: list[torch.Tensor], plan: MLAPlan) -> torch.Tensor:
    """The converted query rows, head by head, each mapped from the head's own d rows by its group's ``maps``
    ([no-RoPE width + RoPE dims, d]). Built in place: at 70B and the latent width it is 4 GB in float64."""
    d, group = plan.head_dim, plan.num_heads // plan.num_kv_heads
    width = maps[0].shape[0]
    q_proj = Wq.new_empty(plan.num_heads * width, Wq.shape[1])
    for h in range(plan.num_heads):
        torch.matmul(maps[h // group], Wq[h * d : (h + 1) * d], out=q_proj[h * width : (h + 1) * width])
    return q_proj


@dataclass
class LayerFactors:
    """One layer's closed form before its format: maps of the augmented input x~ = [x; 1] (bias last)."""

    q_proj: torch.Tensor  # [H * (qk_nope + R), D + 1]
    A: torch.Tensor  # [r, D + 1]: the latent
    K_rope: torch.Tensor  # [R, D + 1]: the shared RoPE key
    kv_b: torch.Tensor  # [H * (qk_nope + d), r]


@torch.no_grad()
def fit_layer(attn, sigma: torch.Tensor, plan: MLAPlan, weighted: bool = True,
              sigma_first: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
              sigma_received: torch.Tensor | None = None, ridge: float = CONSTANT_RIDGE) -> MLAWeights:
    """Closed-form MLA factors for one attention layer from its input second moment ``sigma`` ((D+1)^2) and,
    for the native format, that of each window's first token (``sigma_first``, the attention sink), the
    source's RoPE frequencies ``inv_freq`` (slowly rotating key biases are shrunk; without it they fold whole)
    and the ridge of the constant direction (``constant_direction``). What the cache carries is fitted on
    ``sigma_received`` where given (``layer_factors``)."""
    factors = layer_factors(attn, sigma, plan, weighted, sigma_received)
    if plan.exact:
        return exact_weights(factors, attn, plan)
    return native_weights(factors, sigma, constant_direction(sigma, sigma_first, ridge), pair_frequencies(plan, inv_freq))


def pair_frequencies(plan: MLAPlan, inv_freq: torch.Tensor | None) -> torch.Tensor | None:
    return None if inv_freq is None else torch.tensor(rope_frequencies(plan, inv_freq))


@torch.no_grad()
def layer_factors(attn, sigma: torch.Tensor, plan: MLAPlan, weighted: bool = True,
                  sigma_received: torch.Tensor | None = None) -> LayerFactors:
    """The closed form from the layer's input second moment ``sigma``. What the cache carries (the RoRoPE
    bases, the latent) is fitted on ``sigma_received``, the moment weighted by the attention each token
    receives, where given (``InputStatistics.sigma_received``): on Qwen2.5-Coder-0.5B the attention sink takes
    56% and 61% of layers 11 and 16's attention, and a latent fitted on tokens weighted equally lost 86% and 68%
    of their output (``benchmarks/mla_split_probe.py --received``)."""
    H, G, d, R, r = plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.rope_dim, plan.kv_rank
    Wq = linearised_norm(augmented(attn.q_proj.weight, attn.q_proj.bias), attn, "q", sigma, H)
    Wk = linearised_norm(augmented(attn.k_proj.weight, attn.k_proj.bias), attn, "k", sigma, G)
    Wv = augmented(attn.v_proj.weight, attn.v_proj.bias)
    Wo = attn.o_proj.weight
    group = H // G
    carried = sigma if sigma_received is None else sigma_received
    bases = rorope_bases(Wk, carried, plan)
    rope, nope = split_components(plan)

    def stacked(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(rows) if rows else Wk.new_zeros(0, Wk.shape[1])

    def key_rows(components) -> torch.Tensor:  # k'_{j,i,c} = sum_(g,f) U_i[j, (g, f)] k_{g,f,c}
        return stacked([sum(bases[i][j, m] * Wk[frequency_rows(g, f, d)[c]] for m, (g, f) in enumerate(plan.group_members(i)))
                        for j, i, c in components])

    K_rope, K_nope = key_rows(rope), key_rows(nope)
    mixes = query_mixes(bases, nope, plan)  # q'_{h,j,i,c} = sum_f U_i[j, (g(h), f)] q_{h,f,c}

    M = torch.cat([K_nope, Wv])  # z = [no-RoPE key; values] = M x~
    C = M @ carried @ M.T
    S = consumer_weight(query_moment(Wq, sigma, mixes, plan), Wo, plan, C) if weighted else None
    A, B = latent_factors(M, carried, S, r)
    n_k = plan.nope_key_dim
    B_k, B_v = B[:n_k], B[n_k:]
    if plan.qk_nope_dim == d and d < n_k:
        # Each head's own query rows against its group's no-RoPE key in head coordinates: exact, head_dim wide.
        B_ks = [mix.T @ B_k for mix in mixes]
        nope_maps = [torch.eye(d, dtype=torch.float64)] * G
    else:
        nope_maps = mixes
        if plan.qk_nope_dim < n_k:
            # Reduce the key width to the latent rank: B_k = Q R, so q . (B_k c) = (Q^T q) . (R c).
            Qb, Rb = torch.linalg.qr(B_k)
            B_k = Rb
            nope_maps = [Qb.T @ mix for mix in mixes]
        B_ks = [B_k] * G

    scale = math.sqrt((plan.qk_nope_dim + R) / d)
    maps = [torch.cat([nope, rope_mix]) for nope, rope_mix in zip(nope_maps, query_mixes(bases, rope, plan), strict=True)]
    q_proj = query_projection(Wq, maps, plan).mul_(scale)

    kv_b = torch.cat([torch.cat([B_ks[h // group], B_v[(h // group) * d : (h // group + 1) * d]]) for h in range(H)])
    return LayerFactors(q_proj, A, K_rope, kv_b)


def exact_weights(factors: LayerFactors, attn, plan: MLAPlan) -> MLAWeights:
    """The exact format: the latent norm's channel r is a constant C, so its RMS is C / sqrt(r + 1) for every
    token; biases stay biases."""
    q_proj, A, K_rope, kv_b = factors.q_proj, factors.A, factors.K_rope, factors.kv_b
    r, Wo = plan.kv_rank, attn.o_proj.weight
    rms = NORM_CONSTANT / math.sqrt(r + 1)
    constant_row = torch.zeros(1, A.shape[1], dtype=torch.float64)
    constant_row[0, -1] = NORM_CONSTANT
    kv_a = torch.cat([A, constant_row, K_rope])
    kv_a_norm = torch.cat([torch.full((r,), rms, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    kv_b = torch.cat([kv_b, kv_b.new_zeros(kv_b.shape[0], 1)], dim=1)
    o_bias = attn.o_proj.bias.double() if attn.o_proj.bias is not None else torch.zeros(Wo.shape[0], dtype=torch.float64)
    return MLAWeights(q_proj[:, :-1], q_proj[:, -1], kv_a[:, :-1], kv_a[:, -1], kv_a_norm, kv_b, o_bias)


def constant_direction(sigma: torch.Tensor, sigma_first: torch.Tensor | None = None,
                       ridge: float = CONSTANT_RIDGE) -> torch.Tensor:
    """The direction a with a . x closest to 1 over the calibration tokens (ridge regression of 1 on x, the
    windows' first tokens weighted as much as all others together, since the attention sink's hidden state
    points elsewhere): the constant a bias-free model can still compute from its own normalised input."""
    D = sigma.shape[0] - 1
    gram, target = sigma[:D, :D].clone(), sigma[:D, D].clone()
    if sigma_first is not None:
        gram += sigma_first[:D, :D]
        target += sigma_first[:D, D]
    shift = ridge * gram.diagonal().mean()
    return torch.linalg.solve(gram + shift * torch.eye(D, dtype=gram.dtype), target)


def rope_bias_shrinkage(frequencies: torch.Tensor, spread: float, span: int = ROTATION_SPAN) -> torch.Tensor:
    """Per RoPE key row, how much of its bias to fold through a . x (0: drop it, 1: fold it whole).

    A key bias b on a pair rotating at w adds q_m . R(w (n - m)) b to the score of key n. Folded as
    beta b (a . x_n), the score moves by beta q . R b (a . x_n - 1): what survives the softmax is the spread of
    a . x, relative variance ``spread``. Dropped in part, (1 - beta) q . R b stays missing, and the softmax is
    blind to its part that is the same for every key, so only its rotation over the keys counts: over
    distances uniform in [0, span], 1 - sinc^2(w span / 2) of it. The sum beta^2 spread + (1 - beta)^2 rotation
    is least at beta = rotation / (rotation + spread)."""
    half = frequencies.double().repeat_interleave(2) * span / 2
    rotation = 1 - torch.where(half > 0, torch.sin(half) / half, torch.ones_like(half)).pow(2)
    return rotation / (rotation + spread)


def native_weights(factors: LayerFactors, sigma: torch.Tensor, a: torch.Tensor,
                   rope_frequencies: torch.Tensor | None = None) -> MLAWeights:
    """The engine-native layer: the exact format's constant latent channel, computed without a bias as
    S a . x (about S for every token), so the latent RMSNorm divides every token by about S / sqrt(r + 1) and
    its weight undoes that; S is CHANNEL_DOMINANCE times the latent's RMS size, so the channel rules the norm.
    The error is the spread of a . x around 1 (a few percent on the demo model). Bias columns (Qwen2's q, k, v
    biases) fold the same way: b ~ b (a . x), the RoPE key's shrunk where its pair rotates slowly
    (``rope_bias_shrinkage``, given the pairs' ``rope_frequencies``); the latent's own bias rides on the
    channel through kv_b."""
    q_proj, A, K_rope, kv_b = factors.q_proj, factors.A, factors.K_rope, factors.kv_b
    r = A.shape[0]
    D = sigma.shape[0] - 1
    latent_size = torch.trace(A[:, :D] @ sigma[:D, :D] @ A[:, :D].T).sqrt()
    scale = CHANNEL_DOMINANCE * float(latent_size)

    def folded(W: torch.Tensor, shrink: torch.Tensor | float = 1.0) -> torch.Tensor:
        return W[:, :D] + (shrink * W[:, D])[:, None] * a[None]

    key_shrink = 1.0
    if rope_frequencies is not None:
        mean = float(sigma[:D, D] @ a)
        key_shrink = rope_bias_shrinkage(rope_frequencies, max(float(a @ sigma[:D, :D] @ a) - mean**2, 0.0))
    kv_a = torch.cat([A[:, :D], scale * a[None], folded(K_rope, key_shrink)])
    kv_a_norm = torch.full((r + 1,), scale / math.sqrt(r + 1), dtype=torch.float64)
    kv_a_norm[r] = 1 / math.sqrt(r + 1)
    kv_b = torch.cat([kv_b, kv_b @ A[:, D:]], dim=1)
    q_proj = torch.addr(q_proj[:, :D], q_proj[:, D], a)
    return MLAWeights(q_proj, None, kv_a, None, kv_a_norm, kv_b, None)


def with_dominance(w: MLAWeights, dominance: float) -> MLAWeights:
    """A native closed form with its constant channel (latent row r) at ``dominance`` instead of
    CHANNEL_DOMINANCE: the channel and the norm's weight on the other rows scale together, so a token with
    a . x = 1 gets about the same output (exactly in the limit of a dominant channel); one with a . x near 0 is
    multiplied by at most about ``dominance``."""
    r = w.kv_a_norm.shape[0] - 1
    factor = dominance / CHANNEL_DOMINANCE
    kv_a, norm = w.kv_a_weight.clone(), w.kv_a_norm.clone()
    kv_a[r] *= factor
    norm[:r] *= factor
    return replace(w, kv_a_weight=kv_a, kv_a_norm=norm)


def closed_form_alternatives(w: MLAWeights, plan: MLAPlan) -> list[MLAWeights]:
    """The other closed forms refinement may start from: the native format at each other CHANNEL_DOMINANCES."""
    if plan.exact:
        return []
    return [with_dominance(w, dominance) for dominance in channel_dominances()[1:]]


def channel_dominances() -> list[float]:
    """CHANNEL_DOMINANCES, CHANNEL_DOMINANCE first: the order of a native closed form's alternatives."""
    return sorted(CHANNEL_DOMINANCES, key=lambda dominance: dominance != CHANNEL_DOMINANCE)


def closed_form_labels(plan: MLAPlan) -> list[str]:
    """What each of ``layer_closed_forms`` is, in its order."""
    if plan.exact:
        return ["exact"]
    return [f"ridge {ridge:g}, dominance {dominance:g}" for ridge in constant_ridges() for dominance in channel_dominances()]


def constant_ridges() -> list[float]:
    """CONSTANT_RIDGES, CONSTANT_RIDGE first."""
    return sorted(CONSTANT_RIDGES, key=lambda ridge: ridge != CONSTANT_RIDGE)


def layer_closed_forms(attn, stats: InputStatistics, plan: MLAPlan, weighted: bool,
                       inv_freq: torch.Tensor | None) -> list[MLAWeights]:
    """One layer's closed forms from its input statistics (the cache fitted on the attention each token
    receives where ``stats`` has it): the exact format's one, or the native format's at each of
    CONSTANT_RIDGES (CONSTANT_RIDGE first), each followed by its ``closed_form_alternatives``."""
    factors = layer_factors(attn, stats.sigma, plan, weighted, stats.sigma_received)
    if plan.exact:
        return [exact_weights(factors, attn, plan)]
    frequencies = pair_frequencies(plan, inv_freq)
    forms = []
    for ridge in constant_ridges():
        w = native_weights(factors, stats.sigma, constant_direction(stats.sigma, stats.sigma_first, ridge), frequencies)
        forms += [w, *closed_form_alternatives(w, plan)]
    return forms
