"""``Job``: a recipe's surgery as it runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnsurg.methods.base import SurgeryMethod, method_for
from attnsurg.recipe import Recipe
from attnsurg.requests import Calibration, ModelRef


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

    @property
    def model(self) -> ModelRef:
        return self.recipe.model

    @property
    def output(self) -> Path:
        return self.recipe.output

    @property
    def calibration(self) -> Calibration:
        return self.recipe.calibration

    @property
    def seed(self) -> int:
        return self.recipe.seed

    @property
    def eval_tokens(self) -> int:
        return self.recipe.eval.tokens

    @property
    def eval_domains(self) -> list[str]:
        return self.recipe.eval.domains
