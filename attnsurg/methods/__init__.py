"""Surgery methods: a registry of what each method is and which models it can operate on.

Each method lives in its own module and registers a :class:`MethodSpec` with :func:`register`.
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
    """Import each method module once so it registers itself."""
    from attnsurg.methods import headtensor, loki, lowrank, mla, stacked_tucker  # noqa: F401


_register_builtin_methods()
