"""How a KV budget splits between the shared RoPE key and the latent, chosen on the model's own statistics
(``--split measured``).

Each candidate RoPE width (head_dim / 2^k, at most half the budget, with its default FreqFold) is fitted in
closed form on all calibration windows but the last ``SPLIT_HELD_OUT`` and scored there: the relative error of
every layer's output against the original layer's, the first token left out (an attention sink with an
outsized output). The width with the lowest mean over layers is kept, and the plan says which errors it
compared. On SmolLM2-135M at 0.5 the errors are 0.181 (64 RoPE dims), 0.165 (32, fold 2), 0.211 (16, fold 4);
on Qwen2.5-Coder-0.5B 0.289, 0.257, 0.326 (``benchmarks/mla_split_probe.py``). After refinement the demo's order
is not the closed form's (32 RoPE dims: worst domain x1.726 against x1.481 at 64), so the rule stays the default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import Family
from attnsurg.calibrate import InputStatistics, captured_inputs, causal_mask, embedded, streamed_layers
from attnsurg.io.lazy import rotary_embedding
from attnsurg.errors import UserError
from attnsurg.methods.mla.assemble import deepseek_config
from attnsurg.methods.mla.fit import fit_layer
from attnsurg.methods.mla.plan import MLAPlan, plan_mla
from attnsurg.methods.mla.refine import mla_attention, sampled_output

SPLIT_HELD_OUT = 2  # calibration windows the candidate splits are scored on: the last ones, never fitted on
MIN_ROPE_DIM = 8  # narrower RoPE keys are not tried


def split_candidates(anatomy: AttentionAnatomy, kv_budget: float | None, **plan_options) -> list[MLAPlan]:
    """The plans ``--split measured`` compares: RoPE widths head_dim / 2^k from the head dim down to
    MIN_ROPE_DIM that leave the latent at least half the budget, each with its default FreqFold; a full budget
    has one (every RoPE component kept)."""
    rule = plan_mla(anatomy, kv_budget, **plan_options)
    if rule.cached_values >= rule.original_values:
        return [rule]
    width, plans = anatomy.head_dim, []
    while width >= MIN_ROPE_DIM:
        if 2 * width <= rule.rope_dim + rule.kv_rank:
            try:
                plans.append(plan_mla(anatomy, kv_budget, rope_dim=width, **plan_options))
            except UserError:  # a width the engine asked for would not run
                pass
        width //= 2
    return plans or [rule]


@dataclass
class SplitChoice:
    """The candidates' mean held-out layer errors, in the order tried, and the plan kept."""

    plans: list[MLAPlan]
    errors: list[float] = field(default_factory=list)

    @property
    def chosen(self) -> MLAPlan:
        return self.plans[min(range(len(self.errors)), key=self.errors.__getitem__)] if self.errors else self.plans[0]

    def reason(self) -> str:
        """One line: the split kept and the errors it was chosen against."""
        if len(self.plans) == 1:
            return f"RoPE {self.chosen.rope_dim} dims + latent {self.chosen.kv_rank}: the only split of this budget"
        scored = ", ".join(f"{split_name(p)} {e:.4f}" for p, e in zip(self.plans, self.errors, strict=True))
        return (f"RoPE {self.chosen.rope_dim} dims + latent {self.chosen.kv_rank} chosen: the lowest mean closed-form "
                f"layer error on {SPLIT_HELD_OUT} held-out calibration windows ({scored})")

    def record(self) -> dict:
        return {"candidates": [{"rope_dim": p.rope_dim, "rope_fold": p.rope_fold, "kv_rank": p.kv_rank, "error": e}
                               for p, e in zip(self.plans, self.errors, strict=True)],
                "chosen_rope_dim": self.chosen.rope_dim}


def split_name(plan: MLAPlan) -> str:
    fold = f", fold {plan.rope_fold}" if plan.rope_fold > 1 else ""
    return f"{plan.rope_dim} RoPE{fold}:"


@torch.no_grad()
def closed_form_errors(source: PreTrainedModel | PretrainedConfig, attentions: list, statistics: list[InputStatistics],
                       inputs: list[torch.Tensor], targets: list[torch.Tensor], plan: MLAPlan, weighted: bool,
                       rotary) -> list[float]:
    """Per layer, the relative squared error of the closed-form conversion's output on ``inputs`` against
    the original layer's ``targets`` ([n, L, D] each), the first token of each window left out."""
    config = deepseek_config(source, plan.fitted, rotary.inv_freq)
    config._attn_implementation = "sdpa"
    rope = DeepseekV3RotaryEmbedding(config)(inputs[0][:1], torch.arange(inputs[0].shape[1])[None])
    return [closed_form_error(attention, stats, x, target, plan, weighted, rotary, config, rope, index)
            for index, (attention, stats, x, target) in enumerate(zip(attentions, statistics, inputs, targets, strict=True))]


def closed_form_error(attention, stats: InputStatistics, x: torch.Tensor, target: torch.Tensor, plan: MLAPlan,
                      weighted: bool, rotary, config, rope, index: int = 0) -> float:
    """One layer's closed form fitted on ``stats``, its output on ``x`` against ``target`` (``closed_form_errors``)."""
    weights = fit_layer(attention, stats.sigma, plan, weighted, stats.sigma_first, rotary.inv_freq, stats.sigma_received)
    output = sampled_output(mla_attention(config, index, weights, attention.o_proj.weight), x, rope,
                            torch.arange(x.shape[1]))
    return float((output - target)[:, 1:].pow(2).sum() / target[:, 1:].pow(2).sum())


@torch.no_grad()
def original_outputs(attentions: list, inputs: list[torch.Tensor], rotary) -> list[torch.Tensor]:
    """Each source attention layer's output on its captured inputs ([n, L, D])."""
    length = inputs[0].shape[1]
    positions = torch.arange(length)[None]
    return [attention(hidden_states=x, position_embeddings=rotary(x, positions), attention_mask=causal_mask(length))[0]
            for attention, x in zip(attentions, inputs, strict=True)]


def choose_split(source: PreTrainedModel, attentions: list, fit_statistics: list[InputStatistics],
                 held_out: torch.Tensor, candidates: list[MLAPlan], weighted: bool, rotary) -> SplitChoice:
    """Score every candidate on the ``held_out`` windows (token ids) with closed forms fitted on
    ``fit_statistics`` (statistics of the other windows)."""
    choice = SplitChoice(candidates)
    if len(candidates) == 1:
        return choice
    inputs = captured_inputs(source, attentions, held_out)
    targets = original_outputs(attentions, inputs, rotary)
    for plan in candidates:
        layers = closed_form_errors(source, attentions, fit_statistics, inputs, targets, plan, weighted, rotary)
        choice.errors.append(sum(layers) / len(layers))
    return choice


@torch.no_grad()
def streamed_split(reader, source_config: PretrainedConfig, family: Family, windows: torch.Tensor,
                   candidates: list[MLAPlan], weighted: bool, device: torch.device | None = None,
                   starts: torch.Tensor | None = None, received: bool = False) -> SplitChoice:
    """``choose_split`` with one source layer in memory at a time: the fitted windows' and the held-out ones'
    residual streams carried through the layers side by side (each layer read twice), every candidate's
    closed form fitted and scored at each layer before the next is read. A pass of its own before the
    conversion's."""
    choice = SplitChoice(candidates)
    if len(candidates) == 1:
        return choice
    fit, held = (embedded(reader, source_config, family, windows[:-SPLIT_HELD_OUT]),
                 embedded(reader, source_config, family, windows[-SPLIT_HELD_OUT:]))
    hooked, weighed = (family.attention_attr,), (family.attention_attr,) if received else ()
    fitted = streamed_layers(reader, source_config, family, fit, hooked, device, received=weighed,
                             starts=None if starts is None else starts[:-SPLIT_HELD_OUT])
    scored = streamed_layers(reader, source_config, family, held, (), device)
    rotary = rotary_embedding(source_config)
    configs = [deepseek_config(source_config, plan.fitted, rotary.inv_freq) for plan in candidates]
    for config in configs:
        config._attn_implementation = "sdpa"
    positions = torch.arange(held.shape[1])[None]
    ropes = [DeepseekV3RotaryEmbedding(config)(held[:1], positions) for config in configs]
    errors = [[] for _ in candidates]
    for (index, _, (stats,), _), (_, layer, _, advanced) in zip(fitted, scored, strict=True):
        attention = getattr(layer, family.attention_attr)
        x = getattr(layer, family.input_norm)(held)
        target = original_outputs([attention], [x], rotary)[0]
        for row, plan, config, rope in zip(errors, candidates, configs, ropes, strict=True):
            row.append(closed_form_error(attention, stats, x, target, plan, weighted, rotary, config, rope, index))
        held = advanced.cpu()
    choice.errors = [sum(row) / len(row) for row in errors]
    return choice


def merged(first: InputStatistics, second: InputStatistics) -> InputStatistics:
    """The statistics of both sets of windows, as one pass over all of them would accumulate them."""
    total = InputStatistics()
    total.tokens, total.windows = first.tokens + second.tokens, first.windows + second.windows
    for name in ("moment", "first_moment", "received_moment", "abs_sum"):
        a, b = getattr(first, name), getattr(second, name)
        setattr(total, name, None if a is None or b is None else a + b.to(a.device))
    return total


def check_measurable(windows: int, kv_rank: int | None, rope_dim: int | None, rope_fold: int | None) -> None:
    """``--split measured`` chooses the RoPE width and its fold from a budget, with windows to spare."""
    if kv_rank is not None:
        raise UserError("--split measured splits a --kv-budget; with --kv-rank give --rope-dim instead")
    if rope_dim is not None or rope_fold is not None:
        raise UserError("--split measured chooses the RoPE width and its fold; drop --rope-dim/--rope-fold, or --split")
    if windows <= SPLIT_HELD_OUT:
        raise UserError(f"--split measured holds out {SPLIT_HELD_OUT} calibration windows and fits on the rest: "
                        f"calibrate on more than {SPLIT_HELD_OUT} windows (--calib-tokens)")
