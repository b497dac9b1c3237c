"""Surgery methods: a registry of what each method is and which models it can operate on.

Each method lives in its own module (or package) here and registers a :class:`MethodSpec` with :func:`register`
(and its ``base.SurgeryMethod`` with ``base.register_method``). Importing this package is light: every module
is imported, and so registered, on the first question to the registry (:func:`registered_methods`, and
``base``'s and ``planning``'s lookups), so the command line starts without torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnsurg.methods.catalog import modules

if TYPE_CHECKING:
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
_REGISTERED_BY: dict[str, str] = {}  # method name -> the module that registered it

# The order every listing of methods takes (help, errors, ``info --methods``), whatever order their modules were
# imported in: by the module (or package) that registers them (``catalog.CATALOG``), registration order within one.
MODULE_ORDER = modules()


def listing_rank(module: str) -> tuple[int, str]:
    """Where what ``module`` (``attnsurg.methods.X`` or a module of package X) registers comes in a listing."""
    top = module.removeprefix(f"{__name__}.").split(".")[0]
    return (MODULE_ORDER.index(top) if top in MODULE_ORDER else len(MODULE_ORDER), top)


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in METHODS:
        raise ValueError(f"method '{spec.name}' registered twice")
    METHODS[spec.name] = spec
    _REGISTERED_BY[spec.name] = sys._getframe(1).f_globals.get("__name__", "")
    return spec


def registered_methods() -> dict[str, MethodSpec]:
    """Every method, by name, in listing order (``MODULE_ORDER``)."""
    ensure_registered()
    return dict(sorted(METHODS.items(), key=lambda item: listing_rank(_REGISTERED_BY[item[0]])))


def method_support(anatomy: AttentionAnatomy) -> dict[str, str | None]:
    """For each registered method: None if it supports the model, else the reason it does not."""
    return {name: spec.unsupported_reason(anatomy) for name, spec in registered_methods().items()}


_registering = False


def ensure_registered() -> None:
    """Import every module of this package and its subpackages once, so each method registers itself: a new
    method is one new module (or package) here."""
    global _registering
    if _registering:
        return
    _registering = True
    import importlib
    import pkgutil

    try:
        for module in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
            importlib.import_module(module.name)
    except BaseException:
        _registering = False  # a failed import is raised again by the next question, never a silent half registry
        raise
