"""What ``analyze plan`` asks of a method: its budget knob and a per-layer error proxy measured on the source
model at every candidate budget without converting it (``PlannedMethod``), registered by the method's own
module with :func:`register_planned`. ``analyze/plan.py`` fits the proxies to real conversions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import BaseModel
from transformers import PreTrainedModel

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import Family
from attnsurg.calibrate import attention_layers
from attnsurg.heads import attention_probabilities, head_projections, layer_masking, softmax_scale
from attnsurg.requests import PlanRequest

PROXY_WINDOWS = 2  # calibration windows the attention-based proxies (loki, mla) are measured on


@dataclass(frozen=True)
class ScoredText:
    """A text every ratio is measured on: its eval windows and the source's perplexity there."""

    name: str
    windows: tuple  # (tokens, windows)
    ppl_source: float


@dataclass
class PlanContext:
    """The source in float32, its calibration windows and statistics, and the windows every ratio is scored on."""

    request: PlanRequest
    model: PreTrainedModel
    tokenizer: object
    anatomy: AttentionAnatomy
    family: Family
    device: torch.device
    windows: torch.Tensor
    stats: list  # per layer: (attention input, o_proj input) statistics
    scored: list[ScoredText]  # the calibration text's eval part first, then the other domains

    def attentions(self) -> list[torch.nn.Module]:
        return attention_layers(self.model, self.family)


Proxy = Callable[[PlanContext, tuple[float, ...]], list[list[float]]]  # [budget][layer]


@dataclass(frozen=True)
class PlannedMethod:
    """A method's budget knob: candidate budgets, the two anchor budgets converted for real, the recipe step
    at a budget and the per-layer proxy at every budget ([budget][layer]).

    ``floor_budget``: where the proxy vanishes but the method still changes the model (loki-variance at full
    variance: exact scores, yet each query keeps only a quarter of its keys). It is converted for real too and
    its ratio is the error model's floor; without one the floor is x1 (the method is exact at proxy 0)."""

    name: str
    budgets: tuple[float, ...]
    anchors: tuple[float, float]
    settings: Callable[[float, AttentionAnatomy], BaseModel]
    proxy: Proxy
    floor_budget: float | None = None


PLANNED: dict[str, PlannedMethod] = {}


def planned_methods() -> dict[str, PlannedMethod]:
    """Every method ``analyze plan`` can plan, by name, in listing order (each module of ``attnsurg.methods``
    imported first)."""
    from attnsurg.methods import ensure_registered, listing_rank

    ensure_registered()
    return dict(sorted(PLANNED.items(), key=lambda item: listing_rank(item[1].proxy.__module__)))


def register_planned(*methods: PlannedMethod) -> None:
    for method in methods:
        if method.name in PLANNED:
            raise ValueError(f"planned method '{method.name}' registered twice")
        PLANNED[method.name] = method


def layer_attention(ctx: PlanContext, layer: int, attention, window: torch.Tensor):
    """One calibration window's post-RoPE queries and keys [heads, L, d] (keys repeated to the query heads) at
    ``layer``, its attention probabilities as the layer computes them, and the layer's sliding window."""
    rope = ctx.family.layer_rotary(ctx.model, layer)(window[None], torch.arange(window.shape[0])[None])
    _, _, _, query, key = head_projections(attention, window[None], rope)
    key = key.repeat_interleave(ctx.anatomy.num_heads // ctx.anatomy.num_kv_heads, dim=0)
    masking = layer_masking(attention)
    scale = softmax_scale(attention)
    return query, key, attention_probabilities(query, key, scale, **masking), masking["window"]
