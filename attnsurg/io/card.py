"""Model cards: what a checkpoint is, the exact command or recipe that made it, and its figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from huggingface_hub import ModelCard, ModelCardData

import attnsurg

VERSIONED_PACKAGES = ("torch", "transformers", "accelerate", "tensorly", "safetensors", "huggingface_hub")


@dataclass
class CardInfo:
    """What the card says. ``figures`` rows are ``{"metric": ..., "before": ..., "after": ...}``."""

    title: str
    summary: str
    base_model: str | None = None
    command: str | None = None
    recipe_yaml: str | None = None
    figures: list[dict[str, str]] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    sections: dict[str, str] = field(default_factory=dict)  # heading -> markdown, after the figures


def library_versions() -> dict[str, str]:
    versions = {"attnsurg": attnsurg.__version__}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def _figures_table(rows: list[dict[str, str]]) -> str:
    lines = ["| metric | before | after |", "|---|---|---|"]
    lines += [f"| {r['metric']} | {r.get('before', '')} | {r.get('after', '')} |" for r in rows]
    return "\n".join(lines)


def render_card(info: CardInfo) -> ModelCard:
    data = ModelCardData(library_name="transformers", tags=["attnsurg"], base_model=info.base_model)
    sections = [f"# {info.title}", info.summary]
    if info.details:
        sections.append("\n".join(f"- {d}" for d in info.details))
    if info.figures:
        sections.append("## Figures\n\n" + _figures_table(info.figures))
    sections += [f"## {heading}\n\n{body}" for heading, body in info.sections.items()]
    if info.command:
        sections.append(f"## How it was made\n\n```bash\n{info.command}\n```")
    if info.recipe_yaml:
        sections.append(f"## Recipe\n\n```yaml\n{info.recipe_yaml.rstrip()}\n```")
    versions = "\n".join(f"- {name} {v}" for name, v in library_versions().items())
    sections.append(f"## Library versions\n\n{versions}")
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"
    return ModelCard(content)
