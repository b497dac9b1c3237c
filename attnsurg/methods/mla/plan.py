"""The MLA plan: how a KV budget is spent (RoPE width, FreqFold, latent rank, nope width), checked against
the engines that will read it."""

from __future__ import annotations

from dataclasses import dataclass, replace


from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import SURGERY_FAMILIES, blocking_features, family_for_surgery, llama_like_reason
from attnsurg.errors import UserError
from attnsurg.methods.mla.engines import ENGINES, VLLM_MLA_WIDTHS, engine_problems, vllm_head_dims, vllm_split


SUPPORTED_ROPE = ("default", "llama3")


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
    nope_width: str = "head"  # per-head no-RoPE query/key width: "head" (head_dim) or "latent" (the latent's width)
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


# The widest RoPE key a budget below the whole cache gets by default: DeepSeek-V2/V3's qk_rope_head_dim, the one
# RoPE width of vLLM's MLA prefill shapes and of FlashMLA, and TransMLA's on Llama-3-8B. A wider one costs every
# head R query rows: at 128 an 8B model's converted attention holds 61.9M parameters per layer, at 64 54.0M
# (the source 41.9M). Neither real model measured here (head_dim 64) reaches it.
DEFAULT_MAX_ROPE = 64


def default_rope_dim(values: int, head_dim: int, max_rope: int, original: int) -> int:
    """Every RoPE component when the whole original cache is kept (exact in the flexible layout); otherwise
    the widest head_dim / f (f = 1, 2, 4, ...: one pair per FreqFold group of f frequencies) within a third of
    the budget and at most DEFAULT_MAX_ROPE. Measured on the demo model with refinement: at 0.5, 64 RoPE + 128
    latent x1.25 vs 96 + 96 x1.36; at 0.25, 32 + 64 x3.32 vs 48 + 48 x3.63 vs 16 + 80 x5.57 (2 x 1024 tokens):
    the latent is worth more than RoPE beyond a third, whatever the number of KV heads. Qwen2.5-Coder-0.5B (2 KV
    heads) at 0.5 has 128 values: 64 RoPE dims x1.81 wiki, x3.47 c4, x3.08 code; 42 (a third, no fold) x1.66,
    x3.25, x3.25; 32 with fold 2 x1.46, x2.46, x2.93."""
    if values >= original:
        return max_rope
    width = head_dim
    while width > 2 and (width > 2 * (values // 6) or width > DEFAULT_MAX_ROPE):
        width //= 2
    return width


def split_reason(plan: MLAPlan) -> str:
    """One line: how the plan spends its budget and why, where no measurement chose it (``--split rule``)."""
    values, R, r = plan.rope_dim + plan.kv_rank, plan.rope_dim, plan.kv_rank
    fold = f" with FreqFold {plan.rope_fold}" if plan.rope_fold > 1 else ""
    if plan.engine == "vllm" and plan.cached_values in VLLM_MLA_WIDTHS:
        return (f"RoPE {R} dims{fold} + latent {r} + its norm channel: {plan.cached_values} values per token, "
                f"one of the widths vLLM's MLA kernels cache ({', '.join(map(str, VLLM_MLA_WIDTHS))}; with "
                "--engine vllm a budget takes the widest it reaches)")
    if values >= plan.original_values:
        return f"RoPE {R} dims{fold} + latent {r}: the whole cache"
    max_rope = plan.head_dim if plan.layout == "standard" else plan.num_kv_heads * plan.head_dim
    if R != default_rope_dim(values, plan.head_dim, max_rope, plan.original_values):
        return f"RoPE {R} dims{fold} + latent {r}: the RoPE width asked for"
    cap = f" and at most {DEFAULT_MAX_ROPE}" if plan.head_dim > DEFAULT_MAX_ROPE else ""
    return (f"RoPE {R} dims{fold} + latent {r}: the widest head_dim / 2^k within a third of the {values} values{cap} "
            "(--split measured compares the splits on held-out calibration windows instead)")


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
    nope_width: str = "head",
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
        if engine == "vllm" and rope_dim is None:
            rope_dim, kv_rank = vllm_split(values, original, d, kv_budget)
        else:
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
