"""What a run records about itself and its source: the command line, peak memory, the source's card data,
license and note, parameter counts, generation settings and healing."""

from __future__ import annotations

import resource
import shlex
import sys
from pathlib import Path

from transformers import GenerationConfig, PreTrainedModel

from attnsurg.io.card import CardInfo


def command_line() -> str | None:
    """The attnsurg command this process runs, or None where attnsurg runs as a library (a script's own
    arguments are not an attnsurg command; the card's recipe says how the checkpoint was made)."""
    program = Path(sys.argv[0])
    if program.name != "attnsurg" and program.parts[-2:] != ("attnsurg", "__main__.py"):
        return None
    return "attnsurg " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def peak_memory_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def base_model_id(ref: str) -> str | None:
    """The hub id for the card's ``base_model``: a built-in model's home, a hub id, or what a local source's
    own card names."""
    from attnsurg.io.assets import ASSETS

    if ref in ASSETS:
        return ASSETS[ref].hub_id
    if "/" in ref and not ref.startswith((".", "/", "~")) and not Path(ref).exists():
        return ref
    return source_card_data(ref).get("base_model")


def source_card_data(ref: str) -> dict:
    """The metadata of a local source's own model card (README.md front matter), if it has one."""
    from huggingface_hub import ModelCard

    card = Path(ref).expanduser() / "README.md"
    try:
        return ModelCard.load(card).data.to_dict() if card.is_file() else {}
    except Exception:  # noqa: BLE001 - a card we cannot parse is a card without metadata
        return {}


def source_license(ref: str) -> str | None:
    from attnsurg.io.assets import ASSETS

    return ASSETS[ref].license if ref in ASSETS else source_card_data(ref).get("license")


def source_note(ref: str) -> str | None:
    """What a built-in source is, for the card: where its weights came from."""
    from attnsurg.io.assets import ASSETS

    if ref not in ASSETS:
        return None
    asset = ASSETS[ref]
    kind = "opt-in real model" if asset.opt_in else "demo model"
    return (f"Source: `{ref}`, attnsurg's built-in {kind}: {asset.description} "
            f"(`{asset.file_name()}` from the PyPI wheel{'s' if asset.more_chunks else ''} {asset.source()}).")


def parameter_rows(source: PreTrainedModel, result: PreTrainedModel, attention_attr: str) -> list[dict[str, str]]:
    """The card's parameter counts, attention and total, before and after."""
    def counts(model: PreTrainedModel) -> tuple[int, int]:
        params = dict(model.named_parameters())  # tied weights once
        attention = sum(p.numel() for name, p in params.items() if f".{attention_attr}." in name)
        return attention, sum(p.numel() for p in params.values())

    (attention_before, total_before), (attention_after, total_after) = counts(source), counts(result)
    return [{"metric": "attention parameters", "before": f"{attention_before:,}", "after": f"{attention_after:,}"},
            {"metric": "parameters in all", "before": f"{total_before:,}", "after": f"{total_after:,}"}]


def generation_config(source_path: str, config) -> GenerationConfig:
    """The source's generation settings (eos and the like), or those its config implies."""
    try:
        return GenerationConfig.from_pretrained(source_path)
    except OSError:
        return GenerationConfig.from_model_config(config)


def healing_note(report) -> str:
    """The card's word on healing: "no healing", or what healing will be described below."""
    return "healed after the surgery (see below)" if getattr(report, "heal", None) is not None else "no healing"


def trained_part(settings) -> str:
    if settings.train == "lora":
        return f"LoRA adapters of rank {settings.lora_rank} on the attention, merged into the weights"
    return settings.train


def add_healing(info: CardInfo, heal, settings, ppl_original: float | None = None) -> None:
    data = settings.data.dataset or str(settings.data.text)
    teacher = settings.teacher.ref if settings.teacher else "the source model"
    info.details.append(
        f"healing: distillation from {teacher} (KL weight {settings.kl_weight}, LM weight {settings.lm_weight}, "
        f"T {settings.temperature}) on {heal.tokens:,} tokens of the {settings.data.part} part of {data}, "
        f"{heal.steps} steps of {heal.tokens_per_step} tokens, lr {settings.lr} ({settings.schedule}), training "
        f"{trained_part(settings)} ({heal.trainable_parameters:,} parameters), {heal.tokens_per_second:,.0f} tokens/s"
    )
    if heal.ppl_start is not None and ppl_original is not None:
        info.figures.append({"metric": "ppl after the surgery, before healing (same windows)",
                             "before": f"{ppl_original:.3f}", "after": f"{heal.ppl_start:.3f}"})
    if heal.losses:
        info.figures.append({"metric": "distillation loss (first step, last step)",
                             "before": f"{heal.losses[0][1]:.4f}", "after": f"{heal.losses[-1][1]:.4f}"})
