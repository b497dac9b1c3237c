"""Surgery methods: a registry of what each method is and which models it can operate on.

Each method lives in its own module of this package and registers a :class:`MethodSpec` with :func:`register`
(and its ``base.SurgeryMethod`` with ``base.register_method``); importing the package
imports every module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from attnsurg.arch.anatomy import AttentionAnatomy


@dataclass(frozen=True)
class MethodSpec:
    """``unsupported_reason`` returns None when the method can operate on the model, else why not."""

    name: str
    summary: str
    unsupported_reason: Callable[[AttentionAnatomy], str | None]
    full_budget: str | Callable[[AttentionAnatomy], str] = "exact"  # what a full budget gives where the method
    # applies (exact, or how it is fitted), or a function of the model's anatomy that says it

    def full_budget_for(self, anatomy: AttentionAnatomy) -> str:
        return self.full_budget(anatomy) if callable(self.full_budget) else self.full_budget


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in METHODS:
        raise ValueError(f"method '{spec.name}' registered twice")
    METHODS[spec.name] = spec
    return spec


def method_support(anatomy: AttentionAnatomy) -> dict[str, str | None]:
    """For each registered method: None if it supports the model, else the reason it does not."""
    return {name: spec.unsupported_reason(anatomy) for name, spec in METHODS.items()}


def _register_builtin_methods() -> None:
    """Import every module of this package once, so each method registers itself: a new method is one new
    module here."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_register_builtin_methods()
