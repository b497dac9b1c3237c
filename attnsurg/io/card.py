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
    license: str | None = None
    tags: list[str] = field(default_factory=list)
    remote_code: bool = False  # the checkpoint's modeling code ships with it (attnsurg's own model types)
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


def loading_snippet(remote_code: bool) -> str:
    """How to load the checkpoint with transformers, for the card."""
    option = ", trust_remote_code=True" if remote_code else ""
    return ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder"{option})\n'
            'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")\n```'
            + ("\n\nThe modeling code ships in this folder (`auto_map`); with attnsurg installed, "
               "`import attnsurg` first and no remote code is run." if remote_code else ""))


def render_card(info: CardInfo) -> ModelCard:
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", license=info.license,
                         tags=["attnsurg", *info.tags], base_model=info.base_model)
    sections = [f"# {info.title}", info.summary]
    if info.details:
        sections.append("\n".join(f"- {d}" for d in info.details))
    if info.figures:
        sections.append("## Figures\n\n" + _figures_table(info.figures))
    sections.append("## Use it\n\n" + loading_snippet(info.remote_code))
    sections += [f"## {heading}\n\n{body}" for heading, body in info.sections.items()]
    if info.command:
        sections.append(f"## How it was made\n\n```bash\n{info.command}\n```")
    if info.recipe_yaml:
        sections.append(f"## Recipe\n\n```yaml\n{info.recipe_yaml.rstrip()}\n```")
    versions = "\n".join(f"- {name} {v}" for name, v in library_versions().items())
    sections.append(f"## Library versions\n\n{versions}")
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"
    return ModelCard(content)
