"""``Job``: a recipe's surgery as it runs."""

from __future__ import annotations

from dataclasses import dataclass

from attnsurg.methods.base import SurgeryMethod, method_for
from attnsurg.recipe import Recipe


@dataclass(frozen=True)
class Job:
    """A recipe's surgery as it runs: the recipe, and what belongs to the run rather than the file (whether it
    may replace an existing output, the device it runs on)."""

    recipe: Recipe
    overwrite: bool = False
    device: str = "auto"

    @property
    def settings(self):
        return self.recipe.surgery

    @property
    def method(self) -> SurgeryMethod:
        return method_for(self.settings)
