"""``Job``: a recipe's surgery as it runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnsurg.methods.base import SurgeryMethod, method_for
from attnsurg.recipe import Recipe


@dataclass(frozen=True)
class Job:
    """A recipe's surgery as it runs: the recipe, and what belongs to the run rather than the file (whether it
    may replace an existing output, the device it runs on)."""

    recipe: Recipe
    overwrite: bool = False
    device: str = "auto"
    reads: tuple[Path, ...] = ()  # what the run reads (``read_paths``), which its output must never replace

    @property
    def settings(self):
        return self.recipe.surgery

    @property
    def method(self) -> SurgeryMethod:
        return method_for(self.settings)


def read_paths(recipe: Recipe, *sources) -> tuple[Path, ...]:
    """The local files a recipe's run reads: each model source (``io.load.ModelSource``) and the calibration text."""
    paths = [source.files for source in sources if source.is_local]
    if recipe.calibration.data.text is not None:
        paths.append(Path(recipe.calibration.data.text))
    return tuple(paths)
