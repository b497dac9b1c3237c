"""LoRA adapters for healing (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3):
each trained attention projection W becomes W + (alpha / r) B A with A: r x in, B: out x r, B starting at zero,
so training starts from the operated model exactly. After healing the products merge into W and the
checkpoint has the operated model's shapes and files. The adapters come from peft.

What trains, as LoLCATs' second stage does (Zhang et al. 2024, section 3.2): adapters on the projections that
``train: attention`` would train in full, and in full the attention's own small parameters that are not a
projection (a linear attention's feature maps, a Tucker core). Values a conversion holds fixed stay fixed.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

ADAPTER = "heal"


def adapted_projections(model: PreTrainedModel) -> dict[str, torch.nn.Linear]:
    """The attention's ``nn.Linear`` modules whose weights train (``requires_grad`` as healing marked them)."""
    return {name: module for name, module in model.named_modules()
            if ".self_attn." in name and isinstance(module, torch.nn.Linear) and module.weight.requires_grad}


def add_lora(model: PreTrainedModel, rank: int, alpha: float, held_rows: dict[str, int]) -> list[torch.nn.Parameter]:
    """Put adapters on the projections marked trainable and freeze those projections; the other trainable
    parameters stay trainable. ``held_rows``: projection name -> an output row a conversion holds fixed, where
    B stays zero. Returns what trains. Seed torch first: A starts random."""
    from peft import LoraConfig, inject_adapter_in_model

    projections = adapted_projections(model)
    if not projections:
        return [p for p in model.parameters() if p.requires_grad]
    in_projections = {id(p) for module in projections.values() for p in module.parameters()}
    own = [p for p in model.parameters() if p.requires_grad and id(p) not in in_projections]
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=list(projections))
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)  # freezes everything but the adapters
    for parameter in own:
        parameter.requires_grad_(True)
    for name, row in held_rows.items():
        if name in projections:
            hold_row(model.get_submodule(name).lora_B[ADAPTER].weight, row)
    return [p for p in model.parameters() if p.requires_grad]


def hold_row(lora_b: torch.nn.Parameter, row: int) -> None:
    """B's row stays at zero where the base weight's row is held, so B A adds nothing there."""
    keep = torch.ones(lora_b.shape[0], 1, dtype=lora_b.dtype, device=lora_b.device)
    keep[row] = 0
    lora_b.register_hook(lambda g: g * keep.to(device=g.device, dtype=g.dtype))


def merge_lora(model: PreTrainedModel) -> int:
    """Fold every adapter into its projection and put the plain projection back; returns how many merged."""
    from peft.tuners.lora import LoraLayer

    adapted = [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    for name, module in adapted:
        module.merge(adapter_names=[ADAPTER])
        model.set_submodule(name, module.get_base_layer())
    return len(adapted)
