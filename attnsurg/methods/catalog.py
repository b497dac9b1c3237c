"""Which surgery methods there are, without importing any of them: each name a command answers to, the step it
runs under (``convert --to`` or ``compress --method``) and the module of ``attnsurg.methods`` that registers it.

The bottom layer of the registry: help texts, error messages and listings read it, so they come without torch;
a method's module registers its spec and class when imported (``methods.ensure_registered``), in this order,
and a test holds the catalog equal to what the modules register. A new method is its module and its lines here.
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Entry(NamedTuple):
    name: str
    step: Literal["convert", "compress"]
    module: str  # under attnsurg.methods: the module or package whose import registers the method


CATALOG: tuple[Entry, ...] = (  # in listing order: help, errors and ``info --methods`` list methods so
    Entry("svd", "compress", "lowrank"),
    Entry("asvd", "compress", "lowrank"),
    Entry("svdllm", "compress", "lowrank"),
    Entry("tucker", "compress", "headtensor"),
    Entry("cp", "compress", "headtensor"),
    Entry("linear", "convert", "linear"),
    Entry("loki", "compress", "loki"),
    Entry("mla", "convert", "mla"),
    Entry("tucker", "compress", "stacked_tucker"),  # --stacked
    Entry("topk", "compress", "topk"),
)


def names(step: Literal["convert", "compress"]) -> list[str]:
    """Every name ``step`` answers to (``--to`` or ``--method`` values), in listing order, each once."""
    return list(dict.fromkeys(entry.name for entry in CATALOG if entry.step == step))


def modules() -> tuple[str, ...]:
    """The modules that register methods, in listing order."""
    return tuple(dict.fromkeys(entry.module for entry in CATALOG))
