"""Assembling factorized checkpoints: the source family's architecture under attnsurg's model type,
with some modules replaced as ``config.attnsurg`` records (see :mod:`attnsurg.modeling.modeling_attnsurg`);
and what their model cards say (ranks per module, parameters, FLOPs, KV cache)."""

from __future__ import annotations

import torch
from rich.table import Table
from transformers import PretrainedConfig, PreTrainedModel

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.methods.base import CardText
from attnsurg.modeling import auto_map
from attnsurg.modeling.modeling_attnsurg import CLASSES


def attnsurg_config(source: PreTrainedModel | PretrainedConfig, surgery: dict):
    """The source family's config under attnsurg's model type, recording ``surgery`` (from a model or its config)."""
    fields = (source if isinstance(source, PretrainedConfig) else source.config).to_dict()
    base = fields["model_type"]  # the loaded form's family (Phi-3 loads as Mistral)
    config_class, model_class = CLASSES[base]
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "attnsurg"):
        fields.pop(key, None)
    config = config_class(**fields, attnsurg=surgery)
    config.auto_map = auto_map(base)
    config.architectures = [model_class.__name__]
    return config


def assemble_factorized(
    source: PreTrainedModel,
    surgery: dict,
    replaced: dict[str, dict[str, torch.Tensor]],
    added: dict[str, torch.Tensor] | None = None,
) -> PreTrainedModel:
    """The attnsurg model with the source's weights, where each module path in ``replaced`` loses its old
    tensors and takes the given ones (names relative to the module), plus ``added`` tensors (full names)."""
    config = attnsurg_config(source, surgery)
    model = CLASSES[source.config.model_type][1](config).to(source.dtype)
    state = source.state_dict()
    for path, tensors in replaced.items():
        for key in [k for k in state if k.startswith(path + ".")]:
            del state[key]
        state.update({f"{path}.{name}": tensor for name, tensor in tensors.items()})
    state.update(added or {})
    return load_complete_state(model, state, source.dtype)


def load_complete_state(model: PreTrainedModel, state: dict[str, torch.Tensor], dtype: torch.dtype) -> PreTrainedModel:
    """Load ``state`` (cast to ``dtype``) into a freshly built model; every tensor must find its place and
    every parameter must be given, except a tied ``lm_head``."""
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    tied = model.config.tie_word_embeddings
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"assembly mismatch: missing {missing}, unexpected {unexpected}")
    if tied:
        model.tie_weights()
    return model.eval()


# --- what a factorized checkpoint's card says ---------------------------------------------------------------

COLUMN_TITLES = {"kv": "k/v latent", "qkvo": "q,k,v,o stacked (head_dim x hidden)",
                 "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def rank_rows(plan, labels: bool = True) -> list[dict]:
    """Per layer: each unit's rank label ("dense", "255", "9x64x140"), or with ``labels=False`` its raw ranks
    (None when dense), with parameters before/after."""
    rows: dict[int, dict] = {}
    for i, unit in enumerate(plan.units):
        row = rows.setdefault(unit.layer, {"layer": unit.layer, "params_before": 0, "params_after": 0})
        row[unit.name] = plan.rank_label(i) if labels else plan.ranks[i]
        row["params_before"] += plan.unit_params(i, after=False)
        row["params_after"] += plan.unit_params(i, after=True)
    return list(rows.values())


def rank_table(plan, note: str | None = None) -> str:
    """The card's ranks per module: a row per layer, a column per ``plan.columns`` entry, then ``note``."""
    header = "| layer | " + " | ".join(COLUMN_TITLES[n] for n in plan.columns) + " |"
    lines = [header, "|---" * (len(plan.columns) + 1) + "|"]
    for row in rank_rows(plan):
        lines.append(f"| {row['layer']} | " + " | ".join(row[n] for n in plan.columns) + " |")
    if note:
        lines.append("\n" + note)
    return "\n".join(lines)


def factorized_figures(plan, anatomy: AttentionAnatomy) -> list[dict]:
    """Parameters, FLOPs and KV cache before and after, for the card."""
    kv_after = plan.kv_values_after()
    return [
        {"metric": "parameters in the targeted projections", "before": f"{plan.params_before():,}", "after": f"{plan.params_after():,}"},
        {"metric": "total parameters", "before": f"{anatomy.total_parameters:,}",
         "after": f"{anatomy.total_parameters - plan.params_before() + plan.params_after():,}"},
        {"metric": "FLOPs per token in the targeted projections", "before": f"{plan.flops_before():,}", "after": f"{plan.flops_after():,}"},
        {"metric": "KV values per token (all layers)", "before": f"{anatomy.kv_values_per_token:,}", "after": f"{kv_after:,}"},
        {"metric": "KV bytes per token (bf16)", "before": f"{anatomy.kv_bytes_per_token('bfloat16'):,}", "after": f"{kv_after * 2:,}"},
    ]


def factorized_card_text(plan, anatomy: AttentionAnatomy, kind: str, budget: str, fit_note: str = "",
                         kv_note: str = "", rank_note: str | None = None) -> CardText:
    """The card of a factorized checkpoint; ``kind`` is "low-rank" or "tensor-decomposed"."""
    projections = ", ".join(COLUMN_TITLES[t] for t in plan.targets)
    return CardText(
        title=f"with {kind} attention ({plan.method})",
        summary=f"Attention projections factorized by attnsurg ({plan.method}).{kv_note}",
        tags=[plan.method, "tensor-decomposition" if kind == "tensor-decomposed" else "low-rank"],
        details=[budget, f"targets: {projections}{fit_note}; consumer-weighted: {plan.weighted}"],
        figures=factorized_figures(plan, anatomy),
        sections={"Ranks per module": rank_table(plan, rank_note)},
    )


def factorized_record(plan, anatomy: AttentionAnatomy) -> dict:
    """The ``--json`` figures of a factorized plan: ranks per unit, parameters, FLOPs and the KV cache."""
    return {"plan": rank_rows(plan, labels=False), "kept_fraction": plan.kept_fraction,
            "params": [plan.params_before(), plan.params_after()],
            "projection_flops_per_token": [plan.flops_before(), plan.flops_after()],
            "kv_values_per_token": [anatomy.kv_values_per_token, plan.kv_values_after()]}


def factorized_text(model: str, plan, anatomy: AttentionAnatomy, dry_run: bool) -> list:
    """The rank table and the budget line the command prints."""
    budget = "KV cache" if plan.kv_latent else "targeted parameters"
    return [plan_table(model, plan, rank_rows(plan), dry_run),
            f"kept {plan.kept_fraction:.3f} of the {budget}; projection params {plan.params_before():,} -> "
            f"{plan.params_after():,}, FLOPs/token {plan.flops_before():,} -> {plan.flops_after():,}; KV values/token "
            f"{anatomy.kv_values_per_token:,} -> {plan.kv_values_after():,}"]


def plan_table(model: str, plan, rows: list[dict], dry_run: bool) -> Table:
    """Ranks per layer; consecutive layers with the same ranks share one row."""
    names = plan.columns
    note = ""
    if dry_run and plan.allocate:
        note = " (uniform; --allocate redistributes after calibration)"
    if dry_run and getattr(plan, "choose_ranks", False):
        note = " (Tucker heads x head_dim x hidden; the split between modes is chosen per projection after calibration)"
    table = Table(title=f"{plan.method} plan for {model}{note}", title_justify="left")
    table.add_column("layers", justify="right")
    for name in names:
        table.add_column(COLUMN_TITLES[name], justify="right")
    table.add_column("params/layer", justify="right")
    groups: list[list[dict]] = []
    for row in rows:
        key = [row[n] for n in names]
        if groups and [groups[-1][0][n] for n in names] == key:
            groups[-1].append(row)
        else:
            groups.append([row])
    for group in groups:
        first, last = group[0], group[-1]
        span = str(first["layer"]) if first is last else f"{first['layer']}-{last['layer']}"
        cells = [first[n] for n in names]
        table.add_row(span, *cells, f"{first['params_before']:,} -> {first['params_after']:,}")
    return table
