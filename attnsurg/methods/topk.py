"""Exact top-k attention: each query attends over the ``top_k`` keys with the largest true scores q . k (the
sparsity baseline of Loki, Singhania et al. 2024, sec. 5, which scores keys in a low-rank PCA basis instead).
``compress --method topk --top-k K``.

It needs no calibration and keeps every weight: the checkpoint is Loki's attention at full rank with the
identity basis, so its scores are exact and only the selection changes the model. Against Loki at the same
``top_k`` it separates what the sparsity costs from what the low-rank scores cost; with every key kept it is
the original model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import field_validator

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import Family
from attnsurg.errors import UserError
from attnsurg.methods import MethodSpec, register
from attnsurg.methods.base import CardText, CompressMethod, LayerTensors, register_method
from attnsurg.methods.consumers import LayerContext
from attnsurg.methods.loki import top_k_of
from attnsurg.methods.lowrank import unsupported_reason
from attnsurg.recipe import CompressSettings

NAME = "topk"
register(MethodSpec(NAME, "top-k attention by exact scores (the baseline Loki approximates)", unsupported_reason))


class TopKSettings(CompressSettings):
    """``compress --method topk``: each query attends over its ``top_k`` best keys (a count, or a float in
    (0, 1]: a fraction of its context)."""

    method: Literal["topk"] = NAME
    top_k: int | float | None = None

    @field_validator("top_k", mode="before")
    @classmethod
    def _count_or_share(cls, value):
        return top_k_of(value)


@dataclass
class TopKPlan:
    top_k: int | float
    num_layers: int
    kv_heads: int
    head_dim: int

    def surgery(self) -> dict:
        """Loki's record at full rank: the modeling file's ``LokiAttention`` runs it."""
        return {"format": 1, "method": "loki", "loki": {"rank": self.head_dim, "top_k": self.top_k, "basis": "post-rope"}}

    def top_k_label(self) -> str:
        return f"{self.top_k:g} of each query's context" if isinstance(self.top_k, float) else f"{self.top_k} keys per query"


def plan_topk(anatomy: AttentionAnatomy, top_k: int | float | None) -> TopKPlan:
    if reason := unsupported_reason(anatomy):
        raise UserError(f"cannot apply topk to this model: {reason}")
    if top_k is None or isinstance(top_k, float) and not 0 < top_k <= 1 or isinstance(top_k, int) and top_k < 1:
        raise UserError(f"--top-k must be a count >= 1 or a fraction in (0, 1], got {top_k}")
    return TopKPlan(top_k, anatomy.num_layers, anatomy.num_kv_heads, anatomy.head_dim)


def identity_bases(plan: TopKPlan) -> torch.Tensor:
    """[G, d, d]: every KV head's key basis, the identity (scores in the keys' own coordinates)."""
    return torch.eye(plan.head_dim, dtype=torch.float32).expand(plan.kv_heads, -1, -1).clone()


def basis_name(family: Family, index: int) -> str:
    return f"{family.layers_path}.{index}.{family.attention_attr}.loki_basis"


class TopK(CompressMethod):
    """``compress --method topk``: the weights stay; each layer keeps its top-k keys per query."""

    names = (NAME,)
    settings = TopKSettings
    plan_type = TopKPlan

    def plan(self, anatomy: AttentionAnatomy, settings: TopKSettings) -> TopKPlan:
        return plan_topk(anatomy, settings.top_k)

    def operate_layer(self, plan: TopKPlan, family: Family, index: int, context: LayerContext, seed: int) -> LayerTensors:
        return LayerTensors(added={basis_name(family, index): identity_bases(plan)})

    def surgery(self, plan: TopKPlan, family: Family) -> dict:
        return plan.surgery()

    def apply_records(self, plan: TopKPlan, records: list) -> list[float]:
        return []

    def plan_record(self, plan: TopKPlan, anatomy: AttentionAnatomy) -> dict:
        return {"top_k": plan.top_k}

    def plan_text(self, model: str, plan: TopKPlan, anatomy: AttentionAnatomy, dry_run: bool) -> list:
        return [f"topk plan for {model}: every layer attends over the top {plan.top_k_label()}, by exact scores"]

    def plan_card_text(self, settings: TopKSettings, plan: TopKPlan, anatomy: AttentionAnatomy) -> CardText:
        kv_bytes = f"{anatomy.kv_bytes_per_token('bfloat16'):,}"
        return CardText(
            title=f"with top-k attention (top-k {plan.top_k_label()})",
            summary=("Every layer scores all keys exactly and attends over the best ones only. The weights are the "
                     "original's; the checkpoint adds an identity key basis per layer and KV head (Loki's attention "
                     "at full rank)."),
            tags=["top-k-attention"],
            details=[f"top-k {plan.top_k_label()} (the current token always kept); exact scores"],
            figures=[{"metric": "KV bytes per token (bf16)", "before": kv_bytes, "after": f"{kv_bytes} (unchanged)"}],
        )


register_method(TopK())
