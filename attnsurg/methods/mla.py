"""GQA / MHA -> DeepSeek-style multi-head latent attention (MLA), written as a stock DeepseekV3 checkpoint.

Per layer, with H query heads, G KV heads, head dim d, RoPE pairs (i, i + d/2) rotating at theta^(-2i/d):

1. RoRoPE (TransMLA, Meng et al. 2025, sec. 4): for each frequency i the G key 2-vectors can be mixed by an
   orthogonal G x G matrix U_i without breaking RoPE, since the rotation acts the same on each of them;
   with q'_{h,j,i} = U_i[j, g(h)] q_{h,i} every head's score is unchanged. U_i is the PCA of the keys at
   that frequency (calibration statistics), so component j = 0 carries most of the positional energy.
2. RoPE budget: DeepseekV3 has one RoPE key shared by all heads, of width R. Standard layout: component 0 of
   the R/2 highest frequencies keeps RoPE (rope_theta becomes theta^(R/d), so DeepseekV3's R/2 pairs rotate
   at exactly those frequencies). Where R/2 is at most half the d/2 frequencies, TransMLA's
   FreqFold: f = (d/2) / (R/2) consecutive frequencies form a group whose f G key 2-vectors RoRoPE mixes as one, as
   if all rotated at the group's highest frequency (rope_theta theta^(f R/d)); component 0 of each group keeps
   RoPE, so the kept pairs span the spectrum. Flexible layout (opt-in): further components of each frequency too, up to
   all G (exact at full budget), expressed with longrope per-pair factors. Every other component moves,
   unrotated, to the no-RoPE key.
3. Latent: the no-RoPE key and the values are compressed jointly into a rank-r latent by PCA of their
   calibration second moment, optionally weighted by what consumes them (the query second moment for keys,
   W_o^T W_o per head group for values, each block rescaled to its unweighted energy), computed in float64.
4. Latent norm: DeepseekV3 always applies an RMSNorm to the latent, c / rms(c) * w, which would rescale each
   token's keys (no-RoPE part) and values by a factor of its own (on the demo model the attention sink's
   latent is 3-8 times smaller than other tokens' from the middle layers on). One extra latent channel far
   larger than the latent and (nearly) the same for every token makes the RMS (nearly) constant, and the
   norm weight undoes it, so the latent passes through. Two output formats:
   - exact (transformers only): the channel is a constant bias C >> |latent| (RMS C / sqrt(r + 1) up to a
     relative |c|^2 / 2C^2).
   - native (default; no biases anywhere, as the DeepSeek graphs of llama.cpp, vLLM and SGLang have none):
     the channel is S a . x, with a the direction whose projection of the normalised input is closest to 1
     over the calibration tokens (the sink weighted apart). Its spread around 1 (2-6% off the calibration
     domain on the demo model, against 7-16% for the latent's own size) is the format's error; the source's
     biases fold through it the same way (b ~ b (a . x)), and refinement trains the whole layer, norm and
     channel included, with the norm in place.
5. The softmax scale of DeepseekV3 is (qk_nope + R)^-1/2: the ratio to the original d^-1/2 is folded into q.
   In the exact format, query biases (Qwen2) have no place in DeepseekV3's plain q_proj, so such models route
   q through q_a -> q_a_layernorm -> q_b: q_a is the identity plus one constant channel (the same norm trick),
   which the norm turns into exactly 1, and q_b's column for it is the bias.
6. Refinement (optional, from the closed form; in the native format from whichever of its constant-channel
   dominances, CHANNEL_DOMINANCES, scores lowest on the converted model's own stream): layer by layer, Adam on q_proj, kv_a and kv_b minimizes the
   relative squared error between the converted layer's residual-stream update and what brings the converted
   model's stream back to the original's (layer-wise reconstruction as in BRECQ, Li et al. 2021, carried
   sequentially as in GPTQ). Each token's error is measured relative to the norm of the original stream at
   that token: the next layer reads the stream through an RMSNorm, and without it the first token of every
   window (an attention sink whose residual grows ~10^4 times the others' from the middle layers on) holds
   over 90% of the squared error. In the exact format the norm channels stay frozen. The learning rate is
   constant, or decays on a cosine, which long refinements need.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import SURGERY_FAMILIES, Family, blocking_features, family_for_surgery, llama_like_reason
from attnsurg.calibrate import InputStatistics, additive_mask, input_statistics, prompt_layout
from attnsurg.errors import UserError
from attnsurg.linalg import augmented, rescaled, sqrt_and_inverse_sqrt
from attnsurg.placement import on_device
from attnsurg.methods.factorized import load_complete_state
from attnsurg.methods.lowrank import norm_scale
from attnsurg.methods import MethodSpec, register

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
REFINE_STEP_TOKENS = 512  # tokens per refinement step: whole windows, at least one
REFINE_STEP_QUERIES = 128  # query positions scored per step; every key and value of the windows is kept
WINDOWS_PER_CHUNK = 8  # whole-window forwards over the refinement data run at most this many windows at a time,
CHUNK_BYTES = 1 << 28  # and fewer when their per-head activations would pass this (wide layers, many heads)
SCHEDULES = ("constant", "cosine")
COSINE_FLOOR = 0.1  # the cosine schedule decays the learning rate to this fraction of its peak
HELD_OUT_CHECK = 10  # refinement checks the held-out error every this many steps
HELD_OUT_PATIENCE = 2  # and stops after this many checks without a new lowest one
RATE_BACKOFF = 4  # refinement retries at lr / 4 when no step lowered the layer's error
RATE_RETRIES = 2  # and at most this many times (1e-3, 2.5e-4, 6.25e-5 by default)
HELD_OUT_SHARE = 0.25  # held-out windows per refinement window, when the calibration windows have them
SUPPORTED_ROPE = ("default", "llama3")
# Key distances over which a native-format RoPE key bias keeps its rotation (``rope_bias_shrinkage``): the
# 1024-token windows figures are scored on. Qwen2.5-Coder-0.5B's layer 0 at 0.5, held-out closed-form error:
# spans of 128, 512 and 2048 give 0.085, 0.106 and 0.182; the bias folded whole 0.536, the exact format 0.054.
ROTATION_SPAN = 1024


def unsupported_reason(anatomy: AttentionAnatomy) -> str | None:
    if anatomy.model_type not in SURGERY_FAMILIES:
        return f"the {anatomy.model_type} family is not supported yet ({blocking_features(anatomy)})"
    if anatomy.sliding_window:
        return "sliding-window attention cannot be expressed as MLA"
    if reason := llama_like_reason(anatomy, "MLA"):
        return reason
    if anatomy.rope_type not in SUPPORTED_ROPE:
        return f"RoPE type '{anatomy.rope_type}' (supported: {', '.join(SUPPORTED_ROPE)})"
    return None


def full_budget(anatomy: AttentionAnatomy) -> str:
    if anatomy.qk_norm:
        return "fitted: q/k norms linearised, then refined"
    return "exact with --format exact --rope-layout flexible; native fitted"


register(MethodSpec("mla", "GQA/MHA -> DeepSeek-style latent attention (DeepseekV3 checkpoint)", unsupported_reason,
                    full_budget=full_budget))


@dataclass(frozen=True)
class MLAPlan:
    """The shape of the converted attention (the same in every layer: stock DeepseekV3 has one kv_lora_rank)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    kv_rank: int
    layout: str = "standard"
    query_bias: bool = False  # the source has query biases
    format: str = "native"
    engine: str | None = None  # the engine the checkpoint is laid out for (vLLM: padded head dims, untied lm_head)
    nope_width: str = "latent"  # per-head no-RoPE query/key width: "latent" (refinement's headroom) or "head"
    rope_fold: int = 1  # consecutive frequencies that share one RoPE frequency (FreqFold; standard layout)

    @property
    def exact(self) -> bool:
        return self.format == "exact"

    @property
    def query_route(self) -> bool:
        """The exact format carries query biases through q_a / q_b."""
        return self.exact and self.query_bias

    @property
    def latent_width(self) -> int:
        """kv_lora_rank: the latent and its norm channel (a constant bias in the exact format, a fitted
        near-constant in the native one)."""
        return self.kv_rank + 1

    @property
    def groups(self) -> int:
        """Frequency groups: ``rope_fold`` consecutive frequencies each (the last may hold fewer)."""
        return -(-(self.head_dim // 2) // self.rope_fold)

    def group_frequencies(self, i: int) -> range:
        """The source frequencies of group i (highest first): with a fold, all rotate at the first one's."""
        return range(i * self.rope_fold, min((i + 1) * self.rope_fold, self.head_dim // 2))

    def group_members(self, i: int) -> list[tuple[int, int]]:
        """(KV head, frequency) of each key 2-vector RoRoPE mixes in group i, in the order of its bases."""
        return [(g, f) for g in range(self.num_kv_heads) for f in self.group_frequencies(i)]

    @property
    def counts(self) -> tuple[int, ...]:
        """Per frequency group i (highest first), how many mixed key components keep RoPE: component tier by
        tier, highest frequency first. Measured on the demo model, this order beat an energy-times-rotation
        score: one component of a mid frequency is worth more than a second component of a high one, and no
        mid frequency may be skipped (the standard layout is the first tier)."""
        groups, pairs = self.groups, self.rope_dim // 2
        return tuple(pairs // groups + (1 if i < pairs % groups else 0) for i in range(groups))

    @property
    def original_values(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def nope_key_dim(self) -> int:
        """Width of the unrotated key before compression: everything RoPE does not keep."""
        return self.num_kv_heads * self.head_dim - self.rope_dim

    @property
    def full_rank(self) -> int:
        return self.nope_key_dim + self.num_kv_heads * self.head_dim

    @property
    def qk_nope_dim(self) -> int:
        """Per-head width of the no-RoPE query and key. A head's no-RoPE score is bilinear in its own query
        (head_dim wide) and the latent (kv_rank wide), so the closed form is exact at the narrower of the two:
        ``head`` takes head_dim where that is narrower (``query_mixes``: far fewer parameters, the same
        closed form), ``latent`` the latent's width (the QR reduction), whose extra rank per head refinement
        uses (on the demo model at 0.5, first 2048 tokens: latent x1.319 wiki, x1.469 c4, x1.300 code; head
        x1.486, x1.721, x1.482). Never wider than the unrotated key."""
        width = min(self.nope_key_dim, self.kv_rank)
        return min(self.head_dim, width) if self.nope_width == "head" else width

    @property
    def written_dims(self) -> tuple[int, int]:
        """(qk_nope, v) head dims of the written checkpoint: the fitted ones, or, for vLLM, the smallest of
        its prefill shapes that holds them (zero-padded)."""
        if self.engine == "vllm" and (dims := vllm_head_dims(self)):
            return dims
        return self.qk_nope_dim, self.head_dim

    @property
    def fitted(self) -> MLAPlan:
        """The plan the fit and refinement work in: the same, without an engine's padding."""
        return replace(self, engine=None)

    def attention_parameters(self, hidden: int) -> int:
        """Parameters of one converted attention layer as written (q, kv_a, latent norm, kv_b, o; the exact
        format's biases and query route; an engine's padding)."""
        H, D, R, width = self.num_heads, hidden, self.rope_dim, self.latent_width
        nope, v = self.written_dims
        q_out = H * (nope + R)
        q = (D + 1) * D + 2 * (D + 1) + q_out * (D + 1) if self.query_route else q_out * D
        kv_a = (width + R) * (D + self.exact)
        o = H * v * D + (D if self.exact else 0)
        return q + kv_a + width + H * (nope + v) * width + o

    @property
    def cached_values(self) -> int:
        """Values cached per layer per token: the latent, its norm channel and the RoPE key."""
        return self.latent_width + self.rope_dim


LAYOUTS = ("standard", "flexible")
FORMATS = ("native", "exact")
ENGINES = ("transformers", "llama.cpp", "vllm", "sglang")
# vLLM 0.33's MLA attention (read from its source): latent + RoPE widths its kernels take, and the
# (qk_nope, qk_rope, v) head dims one of its prefill backends takes.
VLLM_MLA_WIDTHS = (320, 512, 576)
VLLM_PREFILL_DIMS = ((128, 64, 128), (192, 64, 256), (64, 64, 128))


def vllm_head_dims(plan: MLAPlan) -> tuple[int, int] | None:
    """The smallest (qk_nope, v) of vLLM's prefill shapes with this RoPE width that holds the plan's dims."""
    fits = [(nope, v) for nope, rope, v in VLLM_PREFILL_DIMS
            if rope == plan.rope_dim and nope >= plan.qk_nope_dim and v >= plan.head_dim]
    return min(fits, key=sum) if fits else None


def vllm_width_hint(plan: MLAPlan) -> str:
    """The vLLM widths this model's KV cache can hold, as the flags that give them."""
    hints = [f"--kv-rank {width - 64 - 1} --rope-dim 64 gives {width} ({width / plan.original_values:.0%} of the cache)"
             for width in VLLM_MLA_WIDTHS if width <= plan.original_values and plan.head_dim >= 64]
    return "; ".join(hints) if hints else f"none fits this model's {plan.original_values} KV values per token"


def engine_problems(plan: MLAPlan, engine: str) -> list[str]:
    """Why an engine's DeepSeek path would not run this plan (empty when it would)."""
    problems = []
    if engine != "transformers" and plan.exact:
        problems.append("the exact format has attention biases its DeepSeek graph lacks (use --format native)")
    if engine != "transformers" and plan.layout == "flexible":
        problems.append("it reads plain RoPE only, not the flexible layout's longrope factors (use --rope-layout standard)")
    if engine == "vllm":
        width, dims = plan.latent_width + plan.rope_dim, (plan.qk_nope_dim, plan.rope_dim, plan.head_dim)
        if width not in VLLM_MLA_WIDTHS:
            problems.append(f"its MLA kernels take kv_lora_rank + qk_rope_head_dim of {', '.join(map(str, VLLM_MLA_WIDTHS))}, "
                            f"this plan has {width} ({vllm_width_hint(plan)})")
        if vllm_head_dims(plan) is None:
            problems.append(f"its prefill takes (qk_nope, qk_rope, v) head dims of "
                            f"{', '.join(str(d) for d in VLLM_PREFILL_DIMS)}, and zero padding cannot reach one from "
                            f"this plan's {dims}")
    return problems


def default_rope_dim(values: int, head_dim: int, max_rope: int, original: int) -> int:
    """Every RoPE component when the whole original cache is kept (exact in the flexible layout); otherwise
    the widest head_dim / f (f = 1, 2, 4, ...: one pair per FreqFold group of f frequencies) within a third of
    the budget. Measured on the demo model with refinement: at 0.5, 64 RoPE + 128 latent x1.25 vs 96 + 96
    x1.36; at 0.25, 32 + 64 x3.32 vs 48 + 48 x3.63 vs 16 + 80 x5.57 (2 x 1024 tokens): the latent is worth
    more than RoPE beyond a third, whatever the number of KV heads. Qwen2.5-Coder-0.5B (2 KV heads) at 0.5 has
    128 values: 64 RoPE dims x1.81 wiki, x3.47 c4, x3.08 code; 42 (a third, no fold) x1.66, x3.25, x3.25;
    32 with fold 2 x1.46, x2.46, x2.93."""
    if values >= original:
        return max_rope
    width = head_dim
    while width > 2 and width > 2 * (values // 6):
        width //= 2
    return width


def default_rope_fold(head_dim: int, rope_dim: int, layout: str) -> int:
    """TransMLA's FreqFold (Meng et al. 2025) wherever the standard layout's R/2 pairs cannot give
    every frequency its own: fold as many neighbours into each pair as still leaves one pair per group, so the
    kept pairs span the whole spectrum instead of its fastest half. Measured on the demo model at 0.25 (32 RoPE
    dims, six-domain calibration, 2 x 1024 tokens): fold 2 gives x3.141 wiki, x6.291 c4, x5.241 code, x4.532
    multilingual against x4.570, x10.98, x9.617, x5.658 without."""
    return max(1, (head_dim // 2) // (rope_dim // 2)) if layout == "standard" else 1


def plan_mla(
    anatomy: AttentionAnatomy,
    kv_budget: float | None = None,
    kv_rank: int | None = None,
    rope_dim: int | None = None,
    layout: str = "standard",
    format: str = "native",
    engine: str | None = None,
    nope_width: str = "latent",
    rope_fold: int | None = None,
) -> MLAPlan:
    """Turn a budget (fraction of the original KV cache) or explicit sizes into a plan; clear errors otherwise."""
    reason = unsupported_reason(anatomy)
    if reason:
        family_for_surgery(anatomy.model_type)
        raise UserError(f"cannot convert to MLA: {reason}")
    d, G = anatomy.head_dim, anatomy.num_kv_heads
    original = 2 * G * d
    if layout not in LAYOUTS:
        raise UserError(f"unknown RoPE layout '{layout}'; choose {' or '.join(LAYOUTS)}")
    if format not in FORMATS:
        raise UserError(f"unknown MLA format '{format}'; choose {' or '.join(FORMATS)}")
    # The standard layout holds each frequency once; the flexible one up to G times (one per KV head).
    max_rope = d if layout == "standard" else G * d
    if kv_budget is not None and (kv_rank is not None):
        raise UserError("give either --kv-budget or --kv-rank (with --rope-dim), not both")
    if kv_budget is None and kv_rank is None:
        kv_budget = 0.5
    if kv_budget is not None:
        if not 0 < kv_budget <= 1:
            raise UserError(f"--kv-budget must be in (0, 1], got {kv_budget}")
        values = max(2, round(kv_budget * original))
        rope_dim = default_rope_dim(values, d, max_rope, original) if rope_dim is None else rope_dim
        kv_rank = values - rope_dim  # the latent-norm channel is one extra value on top of the budget
    rope_dim = d if rope_dim is None else rope_dim
    if rope_dim < 2 or rope_dim % 2 or rope_dim > max_rope:
        where = f"the head dim ({d})" if layout == "standard" else f"KV heads x head dim ({max_rope})"
        raise UserError(f"--rope-dim must be even and between 2 and {where} for the {layout} layout, got {rope_dim}")
    fold = default_rope_fold(d, rope_dim, layout) if rope_fold is None else rope_fold
    if fold != 1 and layout != "standard":
        raise UserError("--rope-fold applies to the standard layout only (the flexible one gives every frequency its own pairs)")
    if fold < 1 or (fold > 1 and -(-(d // 2) // fold) < rope_dim // 2):  # fewer groups than RoPE pairs
        raise UserError(f"--rope-fold {fold} leaves fewer frequency groups than the {rope_dim // 2} RoPE pairs of "
                        f"--rope-dim {rope_dim}; use at most {default_rope_fold(d, rope_dim, layout)}")
    plan = MLAPlan(anatomy.num_layers, anatomy.num_heads, G, d, rope_dim, int(kv_rank), layout,
                   query_bias=anatomy.q_bias, format=format, nope_width=nope_width, rope_fold=fold)
    if plan.kv_rank < 1:
        raise UserError(f"the budget leaves no latent after {rope_dim} RoPE dims; raise --kv-budget or lower --rope-dim")
    if plan.kv_rank > plan.full_rank:
        raise UserError(f"--kv-rank {plan.kv_rank} is above the full rank {plan.full_rank} of keys and values")
    if engine is not None:
        if engine not in ENGINES:
            raise UserError(f"unknown engine '{engine}'; choose {', '.join(ENGINES)}")
        if problems := engine_problems(plan, engine):
            raise UserError(f"{engine} would not run this conversion: " + "; ".join(problems))
        plan = replace(plan, engine=engine)
    return plan


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


@torch.no_grad()
def fit_layer(attn, sigma: torch.Tensor, plan: MLAPlan, weighted: bool = True,
              sigma_first: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
              sigma_received: torch.Tensor | None = None) -> MLAWeights:
    """Closed-form MLA factors for one attention layer from its input second moment ``sigma`` ((D+1)^2) and,
    for the native format, that of each window's first token (``sigma_first``, the attention sink) and the
    source's RoPE frequencies ``inv_freq`` (slowly rotating key biases are shrunk; without it they fold whole).
    What the cache carries (the RoRoPE bases, the latent) is fitted on ``sigma_received``, the moment weighted
    by the attention each token receives, where given (``InputStatistics.sigma_received``): on Qwen2.5-Coder-0.5B
    the attention sink takes 56% and 61% of layers 11 and 16's attention, and a latent fitted on tokens weighted
    equally lost 86% and 68% of their output (``benchmarks/mla_split_probe.py --received``)."""
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
    if not plan.exact:
        frequencies = None if inv_freq is None else torch.tensor(rope_frequencies(plan, inv_freq))
        return native_weights(q_proj, A, K_rope, kv_b, sigma, constant_direction(sigma, sigma_first), frequencies)
    # Latent norm: channel r is a constant C; the RMS is then C / sqrt(r + 1) for every token.
    rms = NORM_CONSTANT / math.sqrt(r + 1)
    constant_row = torch.zeros(1, A.shape[1], dtype=torch.float64)
    constant_row[0, -1] = NORM_CONSTANT
    kv_a = torch.cat([A, constant_row, K_rope])
    kv_a_norm = torch.cat([torch.full((r,), rms, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    kv_b = torch.cat([kv_b, kv_b.new_zeros(kv_b.shape[0], 1)], dim=1)
    o_bias = attn.o_proj.bias.double() if attn.o_proj.bias is not None else torch.zeros(Wo.shape[0], dtype=torch.float64)
    return MLAWeights(q_proj[:, :-1], q_proj[:, -1], kv_a[:, :-1], kv_a[:, -1], kv_a_norm, kv_b, o_bias)


def constant_direction(sigma: torch.Tensor, sigma_first: torch.Tensor | None = None) -> torch.Tensor:
    """The direction a with a . x closest to 1 over the calibration tokens (ridge regression of 1 on x, the
    windows' first tokens weighted as much as all others together, since the attention sink's hidden state
    points elsewhere): the constant a bias-free model can still compute from its own normalised input."""
    D = sigma.shape[0] - 1
    gram, target = sigma[:D, :D].clone(), sigma[:D, D].clone()
    if sigma_first is not None:
        gram += sigma_first[:D, :D]
        target += sigma_first[:D, D]
    ridge = CONSTANT_RIDGE * gram.diagonal().mean()
    return torch.linalg.solve(gram + ridge * torch.eye(D, dtype=gram.dtype), target)


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


def native_weights(q_proj: torch.Tensor, A: torch.Tensor, K_rope: torch.Tensor, kv_b: torch.Tensor,
                   sigma: torch.Tensor, a: torch.Tensor, rope_frequencies: torch.Tensor | None = None) -> MLAWeights:
    """The engine-native layer: the exact format's constant latent channel, computed without a bias as
    S a . x (about S for every token), so the latent RMSNorm divides every token by about S / sqrt(r + 1) and
    its weight undoes that; S is CHANNEL_DOMINANCE times the latent's RMS size, so the channel rules the norm.
    The error is the spread of a . x around 1 (a few percent on the demo model). Bias columns (Qwen2's q, k, v
    biases) fold the same way: b ~ b (a . x), the RoPE key's shrunk where its pair rotates slowly
    (``rope_bias_shrinkage``, given the pairs' ``rope_frequencies``); the latent's own bias rides on the
    channel through kv_b."""
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
    q_proj = q_proj[:, :D].addr_(q_proj[:, D], a)  # folded in place: the fit's largest tensor
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
    return [with_dominance(w, dominance) for dominance in CHANNEL_DOMINANCES if dominance != CHANNEL_DOMINANCE]


def layer_closed_forms(attn, stats: InputStatistics, plan: MLAPlan, weighted: bool,
                       inv_freq: torch.Tensor | None) -> list[MLAWeights]:
    """One layer's closed form from its input statistics (the cache fitted on the attention each token
    receives where ``stats`` has it), then its ``closed_form_alternatives``."""
    w = fit_layer(attn, stats.sigma, plan, weighted, stats.sigma_first, inv_freq, stats.sigma_received)
    return [w, *closed_form_alternatives(w, plan)]


# ----------------------------------------------------------------------------------- the model
def flexible_rope_parameters(plan: MLAPlan, inv_freq: torch.Tensor, theta: float, max_positions: int) -> dict:
    """transformers' longrope type with one factor per pair expresses any frequency list:
    inv_freq_m = 1 / (factor_m * theta^(2m/R)); equal short and long factors and attention_factor 1."""
    R = plan.rope_dim
    factors = [1.0 / (w * theta ** (2 * m / R)) for m, w in enumerate(rope_frequencies(plan, inv_freq))]
    return {
        "rope_type": "longrope",
        "rope_theta": theta,
        "short_factor": factors,
        "long_factor": factors,
        "factor": 1.0,
        "attention_factor": 1.0,
        "original_max_position_embeddings": max_positions,
    }


def deepseek_config(source: PreTrainedModel | PretrainedConfig, plan: MLAPlan, inv_freq: torch.Tensor | None = None,
                    ) -> DeepseekV3Config:
    """A complete DeepseekV3 config for a source model (or its config: the dtype is then the config's): every
    MLP dense, no q LoRA, interleaved RoPE at the kept frequencies.

    Standard layout: the R/2 highest frequencies, by rope_theta = theta^(R/d), or with a fold f every f-th
    from the highest, by theta^(f R/d) (every engine reads it).
    Flexible layout: any frequency list, repeats included, through longrope per-pair factors."""
    c = source if isinstance(source, PretrainedConfig) else source.config
    dtype = c.dtype if isinstance(source, PretrainedConfig) else source.dtype
    rope = dict(c.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    if plan.layout == "flexible":
        rope = flexible_rope_parameters(plan, inv_freq, float(rope["rope_theta"]), c.max_position_embeddings)
    else:
        rope["rope_theta"] = float(rope["rope_theta"]) ** (plan.rope_fold * plan.rope_dim / plan.head_dim)
    return DeepseekV3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=plan.num_heads,
        num_key_value_heads=plan.num_heads,
        n_shared_experts=1,
        n_routed_experts=2,  # unused (every layer dense); llama.cpp asserts n_group < n_routed_experts
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=c.num_hidden_layers,
        kv_lora_rank=plan.latent_width,
        q_lora_rank=c.hidden_size + 1 if plan.query_route else None,
        qk_rope_head_dim=plan.rope_dim,
        qk_nope_head_dim=plan.written_dims[0],
        v_head_dim=plan.written_dims[1],
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=plan.exact,
        attention_dropout=0.0,
        tie_word_embeddings=c.tie_word_embeddings and plan.engine != "vllm",  # vLLM's DeepSeek never ties lm_head
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=getattr(c, "pad_token_id", None),
        dtype=str(dtype or "float32").removeprefix("torch."),
    )


def query_route_state(w: MLAWeights) -> dict[str, torch.Tensor]:
    """q_a = [I; 0] with bias [0; C]: the norm divides by ~C / sqrt(D + 1) for every token (relative error
    |x|^2 / 2C^2); its weight undoes that on x and maps the constant channel to exactly 1, and q_b's column for
    that channel is the query bias."""
    hidden = w.q_proj.shape[1]
    q_a = torch.cat([torch.eye(hidden, dtype=torch.float64), torch.zeros(1, hidden, dtype=torch.float64)])
    q_a_bias = torch.zeros(hidden + 1, dtype=torch.float64)
    q_a_bias[-1] = NORM_CONSTANT
    rms = NORM_CONSTANT / math.sqrt(hidden + 1)
    norm = torch.full((hidden + 1,), rms, dtype=torch.float64)
    norm[-1] = 1 / math.sqrt(hidden + 1)
    return {
        "q_a_proj.weight": q_a,
        "q_a_proj.bias": q_a_bias,
        "q_a_layernorm.weight": norm,
        "q_b_proj.weight": torch.cat([w.q_proj, w.q_bias[:, None]], dim=1),
    }


def attention_state(w: MLAWeights, o_weight: torch.Tensor, query_route: bool) -> dict[str, torch.Tensor]:
    """The state dict of one DeepseekV3 attention module holding a converted layer (no biases when the
    weights have none: the native format)."""
    state = query_route_state(w) if query_route else {"q_proj.weight": w.q_proj}
    state.update({
        "kv_a_proj_with_mqa.weight": w.kv_a_weight,
        "kv_a_layernorm.weight": w.kv_a_norm,
        "kv_b_proj.weight": w.kv_b_proj,
        "o_proj.weight": o_weight,
    })
    if w.kv_a_bias is not None:
        state.update({"kv_a_proj_with_mqa.bias": w.kv_a_bias, "o_proj.bias": w.o_bias})
    return state


def padded_heads(w: MLAWeights, o_weight: torch.Tensor, plan: MLAPlan) -> tuple[MLAWeights, torch.Tensor]:
    """A fitted layer widened to the plan's written head dims with zero rows and columns: per head, q and the
    key half of kv_b get zero no-RoPE dims, the value half of kv_b and o_proj zero value dims, so every score
    and output is unchanged once the softmax scale, (qk_nope + R)^-1/2 in DeepseekV3, is refolded into q."""
    H, n, R, d = plan.num_heads, plan.qk_nope_dim, plan.rope_dim, plan.head_dim
    nope, v = plan.written_dims
    if (nope, v) == (n, d):
        return w, o_weight

    def widened(rows: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
        """Per head, each block of ``width`` rows followed by zero rows up to ``padded``."""
        heads, parts, start = rows.reshape(H, -1, *rows.shape[1:]), [], 0
        for width, padded in blocks:
            parts += [heads[:, start:start + width], heads.new_zeros(H, padded - width, *heads.shape[2:])]
            start += width
        return torch.cat(parts, dim=1).reshape(-1, *rows.shape[1:])

    rescale = math.sqrt((nope + R) / (n + R))
    q_blocks = [(n, nope), (R, R)]
    q_bias = None if w.q_bias is None else widened(w.q_bias, q_blocks) * rescale
    kv_b = widened(w.kv_b_proj, [(n, nope), (d, v)])
    o_proj = widened(o_weight.T, [(d, v)]).T
    return replace(w, q_proj=widened(w.q_proj, q_blocks) * rescale, q_bias=q_bias, kv_b_proj=kv_b), o_proj


@torch.no_grad()
def assemble(source: PreTrainedModel, family: Family, plan: MLAPlan, layers: list[MLAWeights]) -> DeepseekV3ForCausalLM:
    """A DeepseekV3 model with the source's embeddings, norms and MLPs and the converted attention."""
    config = deepseek_config(source, plan, source.get_submodule(family.rotary_path).inv_freq)
    model = DeepseekV3ForCausalLM(config).to(source.dtype)
    attention_prefix = f".{family.attention_attr}."
    state = {k: v for k, v in source.state_dict().items() if attention_prefix not in k}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = source.get_output_embeddings().weight
    for index, w in enumerate(layers):
        prefix = f"{family.layers_path}.{index}.{family.attention_attr}."
        w, o_weight = padded_heads(w, source.get_submodule(prefix + "o_proj").weight.double(), plan)
        state.update({prefix + k: v for k, v in attention_state(w, o_weight, plan.query_route).items()})
    return load_complete_state(model, state, source.dtype)


class LayerError(NamedTuple):
    """A refined layer's relative output error: closed form (before) and kept weights (after), on the
    refinement windows and on the held-out windows refinement never trains on (None without them)."""

    before: float
    after: float
    held_before: float | None = None
    held_after: float | None = None
    steps: int = 0  # Adam steps of the kept weights (0: the closed form was kept)
    lr: float | None = None  # the learning rate of the kept steps (lower than asked after a backoff)


@dataclass
class MLAConversion:
    """A converted model, its plan and each refined layer's output error (before, after refinement)."""

    model: DeepseekV3ForCausalLM
    plan: MLAPlan
    layer_errors: list[LayerError]


# ---------------------------------------------------------------------------------- refinement
@dataclass(frozen=True)
class Refinement:
    """Layer-wise refinement settings: Adam steps per layer, calibration tokens read, peak learning rate and
    its schedule. Measured on the demo model at 25% KV: a constant rate suits short runs (40 steps over 2048
    tokens: x2.86, cosine x2.99); long runs need the decay (320 steps over 32768 tokens: x2.05, cosine x1.86)."""

    steps: int = 40
    tokens: int = 2048
    lr: float = 1e-3
    schedule: str = "constant"


def window_layout(windows: int, length: int, starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's position ``[n, L]`` and what it sees ``[n, L, L]``: plain causal windows, or the prompts
    that ``starts`` cuts them into (``calibrate.short_prompt_starts``)."""
    if starts is None:
        starts = torch.zeros(windows, length, dtype=torch.bool)
        starts[:, 0] = True
    return prompt_layout(starts)


def mla_attention(config: DeepseekV3Config, index: int, w: MLAWeights, o_weight: torch.Tensor) -> DeepseekV3Attention:
    """A float32 DeepseekV3 attention module holding one converted layer."""
    attention = DeepseekV3Attention(config, index)
    state = attention_state(w, o_weight, config.q_lora_rank is not None)
    attention.load_state_dict({k: v.detach().float() for k, v in state.items()})
    return attention


def norm_channel_of(attention: DeepseekV3Attention) -> int | None:
    """The latent row a conversion made constant (zero weights, non-zero bias), if any."""
    kv_a = attention.kv_a_proj_with_mqa
    if kv_a.bias is None:
        return None
    rank = attention.config.kv_lora_rank
    rows = torch.nonzero((kv_a.weight[:rank].abs().amax(dim=1) == 0) & (kv_a.bias[:rank] != 0)).flatten()
    return int(rows[-1]) if len(rows) else None


def hold_norm_channel(attention: DeepseekV3Attention, rank: int) -> None:
    """Keep the latent-norm channel (row ``rank`` of kv_a) at its constant and the query route fixed while
    the rest trains: the latent RMSNorm stays neutralised."""
    attention.kv_a_layernorm.weight.requires_grad_(False)
    if attention.q_a_proj is not None:  # the query route is fixed; q_b (weights and bias column) trains
        attention.q_a_proj.requires_grad_(False)
        attention.q_a_layernorm.requires_grad_(False)
    keep = torch.ones(attention.kv_a_proj_with_mqa.weight.shape[0], 1, device=attention.kv_a_proj_with_mqa.weight.device)
    keep[rank] = 0
    attention.kv_a_proj_with_mqa.weight.register_hook(lambda g: g * keep.to(device=g.device, dtype=g.dtype))
    attention.kv_a_proj_with_mqa.bias.register_hook(lambda g: g * keep[:, 0].to(device=g.device, dtype=g.dtype))


def refined_parameters(attention: DeepseekV3Attention) -> list[torch.nn.Parameter]:
    """Refinement's trainable parameters: everything but o_proj and, in the exact format, the norm channel."""
    channel = norm_channel_of(attention)
    if channel is not None:
        hold_norm_channel(attention, channel)
    attention.o_proj.requires_grad_(False)
    return [p for p in attention.parameters() if p.requires_grad]


def sampled_output(attention: DeepseekV3Attention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   rows: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """The attention output at query positions ``rows`` only, every key and value kept: the same computation
    as ``attention.forward`` (tested equal), at the cost of len(rows) queries instead of all. ``rope`` is
    per window or shared ([n or 1, L, dims]); ``visible`` ([n, L, L] bool) defaults to causal."""
    batch, length = x.shape[:2]
    config = attention.config
    if attention.q_a_proj is None:
        q = attention.q_proj(x[:, rows])
    else:
        q = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(x[:, rows])))
    q = q.view(batch, len(rows), -1, attention.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [attention.qk_nope_head_dim, attention.qk_rope_head_dim], dim=-1)
    latent, k_rot = torch.split(attention.kv_a_proj_with_mqa(x), [config.kv_lora_rank, attention.qk_rope_head_dim], dim=-1)
    latent = attention.kv_a_layernorm(latent).view(batch, 1, length, config.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, length, attention.qk_rope_head_dim)
    cos, sin = rope
    rotate = apply_rotary_pos_emb_interleave if config.rope_interleave else apply_rotary_pos_emb
    q_rot, _ = rotate(q_rot, q_rot[..., :1, :], cos[:, rows], sin[:, rows])
    _, k_rot = rotate(k_rot[..., :1, :], k_rot, cos, sin)
    keys, values = attention.expand_kv(latent, k_rot)
    visible = rows[:, None] >= torch.arange(length, device=rows.device)[None] if visible is None else visible[:, None, rows]
    output = torch.nn.functional.scaled_dot_product_attention(
        torch.cat([q_pass, q_rot], dim=-1), keys, values, attn_mask=visible, scale=attention.scaling
    )
    return attention.o_proj(output.transpose(1, 2).reshape(batch, len(rows), -1))


def windows_at_once(heads: int, length: int, per_position: int) -> int:
    """Windows per whole-window forward: up to WINDOWS_PER_CHUNK, as many as keep the float32 activations
    (``per_position`` values per head and position, plus the scores and probabilities) within CHUNK_BYTES."""
    per_window = 4 * heads * length * (per_position + 2 * length)
    return max(1, min(WINDOWS_PER_CHUNK, CHUNK_BYTES // per_window))


def refine_layer(
    w: MLAWeights, config: DeepseekV3Config, index: int, o_weight: torch.Tensor, x: torch.Tensor, target: torch.Tensor,
    settings: Refinement, token_scale: torch.Tensor | None = None, held_out: int = 0,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None, alternatives: Sequence[MLAWeights] = (),
) -> tuple[MLAWeights, LayerError, torch.Tensor]:
    """Adam on the converted layer so its output on the windows ``x`` matches ``target``; returns the kept
    weights, their errors (on REFINE_STEP_QUERIES fixed query rows of every window) and the layer's output on
    ``x`` with them. Refinement starts from whichever of ``w`` and the ``alternatives`` (other closed forms of
    the same layer) has the lowest error on the training windows.

    The last ``held_out`` windows are never trained on. With them, the held-out error is checked every
    HELD_OUT_CHECK steps: the weights with the lowest one are kept, and refinement stops once it has not
    fallen for HELD_OUT_PATIENCE checks (early stopping). Without them, the closed form is kept when
    refinement does not lower the training error. When no step lowers the error at ``settings.lr``, refinement
    starts again from the closed form at each lower ``backoff_rates`` in turn.

    Each step takes the next REFINE_STEP_TOKENS worth of training windows in turn and scores
    REFINE_STEP_QUERIES random query positions of them against all their keys and values. On the demo model
    40 steps of one 512-token window reached a lower layer error than 20 full-batch steps over 4 windows at
    half the compute; scoring a quarter of the queries per step then halves the default conversion (103 s ->
    55 s at 0.5) for a ppl ratio 2-6% higher (benchmarks/mla_budget.py --refine-queries 512 against the
    default). ``token_scale`` ([n, L, 1]) weights each token's error; ``layout`` (``window_layout``) says
    where the windows' prompts start (default: one per window)."""
    length, train, device = x.shape[1], x.shape[0] - held_out, x.device
    positions, visible = layout if layout is not None else window_layout(x.shape[0], length)
    positions, visible = positions.to(device), visible.to(device)
    cos, sin = DeepseekV3RotaryEmbedding(config).to(device)(x[:1], positions)
    token_scale = torch.ones(*x.shape[:2], 1, device=device) if token_scale is None else token_scale

    def energy_of(windows: slice) -> torch.Tensor:  # errors are relative to their own windows' target
        return (target[windows] * token_scale[windows]).pow(2).mean()

    energy = energy_of(slice(0, train))

    def closed_form() -> DeepseekV3Attention:
        return mla_attention(config, index, w, o_weight.cpu()).to(device)

    queries = min(length, REFINE_STEP_QUERIES)
    generator = torch.Generator().manual_seed(index)  # on the CPU: the same rows on every device

    def random_rows() -> torch.Tensor:
        return torch.randperm(length, generator=generator)[:queries].sort().values.to(device)

    def output_at(rows: torch.Tensor, windows: slice) -> torch.Tensor:
        return sampled_output(attention, x[windows], (cos[windows], sin[windows]), rows, visible[windows])

    def error_at(rows: torch.Tensor, windows: slice, energy: torch.Tensor = energy) -> torch.Tensor:
        error = output_at(rows, windows) - target[windows][:, rows]
        return (error * token_scale[windows][:, rows]).pow(2).mean() / energy

    @torch.no_grad()
    def error_over(start: int, stop: int) -> float | None:
        if stop <= start:
            return None
        whole = energy_of(slice(start, stop))
        chunks = [slice(i, min(i + at_once, stop)) for i in range(start, stop, at_once)]
        return sum(error_at(checked, chunk, whole).item() * (chunk.stop - chunk.start) for chunk in chunks) / (stop - start)

    at_once = windows_at_once(config.num_attention_heads, length,
                              2 * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) + config.qk_nope_head_dim)
    checked = random_rows()  # the same rows of every window score the closed form and the refined layer
    scored = []
    for candidate in (w, *alternatives):
        attention = mla_attention(config, index, candidate, o_weight.cpu()).to(device)
        scored.append((error_over(0, train), len(scored), candidate))
    before, _, w = min(scored)
    attention = closed_form()
    held_before = error_over(train, x.shape[0])
    per_step = min(train, max(1, REFINE_STEP_TOKENS // length))

    def trained(lr: float) -> int:
        """Adam at ``lr`` from ``attention``, which ends holding the kept weights; the steps kept (0: none)."""
        best = (held_before, 0, None)  # held-out error, steps, state
        optimizer = torch.optim.Adam(refined_parameters(attention), lr=lr, fused=True)
        schedule = learning_rate_schedule(optimizer, replace(settings, lr=lr))
        with torch.enable_grad():
            for step in range(1, settings.steps + 1):
                first = ((step - 1) * per_step) % train
                optimizer.zero_grad()
                error_at(random_rows(), slice(first, min(first + per_step, train))).backward()
                optimizer.step()
                schedule.step()
                if held_out and (step % HELD_OUT_CHECK == 0 or step == settings.steps):
                    held = error_over(train, x.shape[0])
                    if held < best[0]:
                        best = (held, step, {k: v.detach().clone() for k, v in attention.state_dict().items()})
                    elif step - best[1] >= HELD_OUT_PATIENCE * HELD_OUT_CHECK:
                        break
        if held_out:
            if best[2] is not None:
                attention.load_state_dict(best[2])
            return best[1]
        return settings.steps if error_over(0, train) < before else 0

    for lr in backoff_rates(settings.lr):
        if steps := trained(lr):
            break
        attention = closed_form()
    with torch.no_grad():
        every_row = torch.arange(length, device=device)
        output = torch.cat([output_at(every_row, slice(i, i + at_once)) for i in range(0, len(x), at_once)])
    errors = LayerError(before, error_over(0, train), held_before, error_over(train, x.shape[0]), steps, lr if steps else None)
    return (weights_of(attention, w) if steps else w), errors, output


def backoff_rates(lr: float) -> list[float]:
    """The learning rates refinement tries in turn, each only if none of the steps at the one before it lowered
    the error (Adam's step is about ``lr`` in every coordinate whatever the gradient's scale, so the rate that
    suits one model's weights overshoots another's: Qwen2.5-Coder-0.5B's q_proj is 13x smaller than
    SmolLM2-135M's, and at 1e-3 no step helped in 15 of its 24 layers)."""
    return [lr / RATE_BACKOFF**k for k in range(RATE_RETRIES + 1)]


def weights_of(attention: DeepseekV3Attention, w: MLAWeights) -> MLAWeights:
    """A refined layer's weights read back from its module (what refinement does not train comes from ``w``)."""
    def read(module: torch.nn.Module, name: str) -> torch.Tensor | None:
        tensor = getattr(module, name)
        return None if tensor is None else tensor.detach().double().cpu()

    if attention.q_b_proj is not None:
        q_b = read(attention.q_b_proj, "weight")
        q_proj, q_bias = q_b[:, :-1], q_b[:, -1]
    else:
        q_proj, q_bias = read(attention.q_proj, "weight"), w.q_bias
    kv_a = attention.kv_a_proj_with_mqa
    return MLAWeights(q_proj, q_bias, read(kv_a, "weight"), read(kv_a, "bias"), read(attention.kv_a_layernorm, "weight"),
                      read(attention.kv_b_proj, "weight"), w.o_bias)


def learning_rate_schedule(optimizer: torch.optim.Optimizer, settings: Refinement) -> torch.optim.lr_scheduler.LRScheduler:
    """Constant, or a cosine decay from the peak to COSINE_FLOOR times the peak over the steps."""
    if settings.schedule == "cosine":
        floor = settings.lr * COSINE_FLOOR
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, settings.steps), eta_min=floor)
    if settings.schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    raise ValueError(f"unknown refinement schedule '{settings.schedule}'; choose {' or '.join(SCHEDULES)}")


class SequentialRefiner:
    """Layer-wise refinement that carries the converted model's own residual stream forward (as GPTQ and
    BRECQ do), so each layer learns to undo the drift of the layers before it: layer l's attention sees
    norm(h'_l) and is fitted to h_l + a_l - h'_l, where h_l, a_l are the original model's residual stream and
    attention output and h'_l is the converted model's residual stream. Both streams advance layer by layer
    from the embeddings, so memory holds two streams whatever the depth. ``starts`` cuts the windows into
    prompts of their own (``calibrate.short_prompt_starts``)."""

    def __init__(self, rotary: torch.nn.Module, family: Family, embeddings: torch.Tensor, config: DeepseekV3Config,
                 held_out: int = 0, starts: torch.Tensor | None = None, device: torch.device | None = None):
        self.device = device or embeddings.device  # where both streams live and each layer is refined
        self.rotary, self.family, self.config, self.held_out = copy.deepcopy(rotary).to(self.device), family, config, held_out
        self.original = embeddings.to(self.device)  # [n, L, D]: the first decoder layer's input on the refinement windows, held-out last
        self.stream = self.original.clone()
        self.layout = tuple(t.to(self.device) for t in window_layout(*embeddings.shape[:2], starts))

    def carried(self) -> dict[str, torch.Tensor]:
        """Both residual streams as the next layer receives them, to resume from (``io.resume``)."""
        return {"original": self.original, "converted": self.stream}

    def resume(self, carried: dict[str, torch.Tensor]) -> None:
        self.original, self.stream = carried["original"].to(self.device), carried["converted"].to(self.device)

    @torch.no_grad()
    def refine(self, index: int, layer: torch.nn.Module, w: MLAWeights, settings: Refinement,
               alternatives: Sequence[MLAWeights] = ()) -> tuple[MLAWeights, LayerError]:
        """Refine decoder layer ``index`` (``layer``: the source's, in float32) from its closed form ``w`` or
        one of its ``alternatives``; the layer is moved to the refiner's device for it and back."""
        with on_device(layer, self.device):
            return self.refine_on_device(index, layer, w, settings, alternatives)

    def refine_on_device(self, index: int, layer: torch.nn.Module, w: MLAWeights, settings: Refinement,
                         alternatives: Sequence[MLAWeights] = ()) -> tuple[MLAWeights, LayerError]:
        source_attn = getattr(layer, self.family.attention_attr)
        norm = getattr(layer, self.family.input_norm)
        attended = self.source_attention(source_attn, norm(self.original))
        target = self.original + attended - self.stream
        token_scale = (self.original + attended).pow(2).mean(-1, keepdim=True).rsqrt()
        w, errors, output = refine_layer(w, self.config, index, source_attn.o_proj.weight, norm(self.stream),
                                         target, settings, token_scale, self.held_out, self.layout, alternatives)
        self.original = self.finish_layer(layer, self.original + attended)
        self.stream = self.finish_layer(layer, self.stream + output)
        return w, errors

    def source_attention(self, attention, x: torch.Tensor) -> torch.Tensor:
        """The original attention's output on every window, a few windows at a time."""
        positions, visible = self.layout
        outputs = []
        at_once = windows_at_once(self.config.num_attention_heads, x.shape[1], 4 * attention.head_dim)
        for i in range(0, len(x), at_once):
            chunk = slice(i, i + at_once)
            rope = self.rotary(x[chunk], positions[chunk])
            outputs.append(attention(hidden_states=x[chunk], position_embeddings=rope,
                                     attention_mask=additive_mask(visible[chunk]))[0])
        return torch.cat(outputs)

    def finish_layer(self, layer, stream: torch.Tensor) -> torch.Tensor:
        """The rest of a decoder layer after its attention's residual add: the MLP's residual add."""
        post_norm = getattr(layer, self.family.post_attention_norm)
        return stream + getattr(layer, self.family.mlp)(post_norm(stream))


@torch.no_grad()
def convert(
    source: PreTrainedModel,
    family: Family,
    windows: torch.Tensor,
    plan: MLAPlan,
    weighted: bool = True,
    refinement: Refinement | None = None,
    progress=None,
    starts: torch.Tensor | None = None,
    device: torch.device | None = None,
    received: bool = False,
) -> MLAConversion:
    """Convert every layer from calibration windows (token ids): the closed form from the attention inputs'
    second moment over all windows, then, given ``refinement`` with steps, sequential refinement on the first
    ``refinement.tokens`` of them, watched on up to HELD_OUT_SHARE as many windows that follow them.
    ``starts`` ([n, L] bool, ``calibrate.short_prompt_starts``) cuts the windows into prompts of their own.
    ``device``: where the calibration pass and refinement run (the fitting runs in float64 on the CPU).
    ``received``: fit what the cache carries on tokens weighted by the attention they receive (``fit_layer``)."""
    # One hooked pass streams each attention input's second moment over all windows; refinement starts from the
    # token embeddings of its windows (the first decoder layer's input in the Llama family).
    attentions = [getattr(layer, family.attention_attr) for layer in source.get_submodule(family.layers_path)]
    statistics = input_statistics(source, attentions, windows, starts, device, received=attentions if received else ())
    refinement = refinement if refinement and refinement.steps else None
    inv_freq = source.get_submodule(family.rotary_path).inv_freq
    config = deepseek_config(source, plan.fitted, inv_freq)
    config._attn_implementation = "sdpa"  # the standalone refinement modules (sampled_output calls sdpa itself)
    refiner = None
    if refinement:
        keep = min(len(windows), max(1, refinement.tokens // windows.shape[1]))
        held_out = min(len(windows) - keep, math.ceil(keep * HELD_OUT_SHARE))
        embeddings = source.get_input_embeddings()(windows[: keep + held_out].to(source.device)).float().cpu()
        used = None if starts is None else starts[: keep + held_out]
        refiner = SequentialRefiner(source.get_submodule(family.rotary_path), family, embeddings, config, held_out, used,
                                    device)
    layers, errors = [], []
    for index, (attn, stats) in enumerate(zip(attentions, statistics)):
        weights, *alternatives = layer_closed_forms(attn, stats, plan, weighted, inv_freq)
        if refiner:
            weights, error = refiner.refine(index, source.get_submodule(f"{family.layers_path}.{index}"), weights, refinement,
                                            alternatives)
            errors.append(error)
        layers.append(weights)
        if progress:
            progress(note=f"layer error {errors[-1].before:.3f} -> {errors[-1].after:.3f}" if errors else "")
    return MLAConversion(assemble(source, family, plan, layers), plan, errors)
