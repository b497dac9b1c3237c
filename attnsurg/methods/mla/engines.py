"""What each engine's DeepSeek path takes, and why it would not run a plan."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from attnsurg.errors import UserError

if TYPE_CHECKING:
    from attnsurg.methods.mla.plan import MLAPlan


ENGINES = ("transformers", "llama.cpp", "vllm", "sglang")
# vLLM 0.33's MLA attention (read from its source): latent + RoPE widths its kernels take, and the
# (qk_nope, qk_rope, v) head dims one of its prefill backends takes.
VLLM_MLA_WIDTHS = (320, 512, 576)
VLLM_PREFILL_DIMS = ((128, 64, 128), (192, 64, 256), (64, 64, 128))
VLLM_ROPE_DIM = 64  # the one qk_rope width of those prefill shapes


def vllm_kv_rank(width: int) -> int:
    """The latent rank that gives a cache ``width`` wide: the latent, its norm channel and the RoPE key."""
    return width - VLLM_ROPE_DIM - 1


def vllm_split(values: int, original: int, head_dim: int, budget: float) -> tuple[int, int]:
    """(rope_dim, kv_rank) of the widest vLLM MLA width within ``values`` cached values per token (the
    latent's norm channel counts toward the width); a UserError saying what the narrowest one would cost
    where the budget reaches none."""
    if head_dim < VLLM_ROPE_DIM:
        raise UserError(f"vllm's MLA prefill takes a RoPE key of {VLLM_ROPE_DIM} dims, wider than this model's "
                        f"head dim {head_dim}; convert without --engine vllm")
    widths = ", ".join(map(str, VLLM_MLA_WIDTHS))
    if fitting := [width for width in VLLM_MLA_WIDTHS if width <= values]:
        return VLLM_ROPE_DIM, vllm_kv_rank(max(fitting))
    narrowest = VLLM_MLA_WIDTHS[0]
    if narrowest > original:
        raise UserError(f"vllm's MLA kernels cache {widths} values per token, and this model's whole KV cache is "
                        f"{original}: every width vllm serves is larger than the original's cache "
                        f"(x{narrowest / original:.2f} at {narrowest}); convert without --engine vllm")
    needed = math.ceil(narrowest / original * 100) / 100
    raise UserError(f"--kv-budget {budget:g} gives {values} of this model's {original} KV values per token, below "
                    f"every width vllm's MLA kernels cache ({widths}); the narrowest, {narrowest}, costs {narrowest / original:.0%} "
                    f"of the cache: pass --kv-budget {needed:g}, or convert without --engine vllm")


def vllm_head_dims(plan: MLAPlan) -> tuple[int, int] | None:
    """The smallest (qk_nope, v) of vLLM's prefill shapes with this RoPE width that holds the plan's dims."""
    fits = [(nope, v) for nope, rope, v in VLLM_PREFILL_DIMS
            if rope == plan.rope_dim and nope >= plan.qk_nope_dim and v >= plan.head_dim]
    return min(fits, key=sum) if fits else None


def vllm_width_hint(plan: MLAPlan) -> str:
    """The vLLM widths this model's KV cache can hold, as the flags that give them."""
    hints = [f"--kv-rank {vllm_kv_rank(width)} --rope-dim {VLLM_ROPE_DIM} gives {width} "
             f"({width / plan.original_values:.0%} of the cache)"
             for width in VLLM_MLA_WIDTHS if width <= plan.original_values and plan.head_dim >= VLLM_ROPE_DIM]
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
