"""The package's import graph has no cycles: every module's top-level imports of attnsurg modules (and the
packages each passes through, whose ``__init__`` runs first; a module's own packages are already running) form
a DAG."""

from __future__ import annotations

import ast
from pathlib import Path

import attnsurg

ROOT = Path(attnsurg.__file__).parent


def module_name(path: Path) -> str:
    return ".".join(("attnsurg", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def top_level_imports(path: Path) -> set[str]:
    """The attnsurg modules ``path``'s module imports at its top level, and every package each passes through
    except the module's own (running already: a submodule that takes a name from its own package's
    ``__init__`` names it explicitly, and that counts)."""
    module = module_name(path)
    named = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attnsurg") and not node.level:
            named.add(node.module)
        elif isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names if alias.name.startswith("attnsurg")}
    passed = {".".join(name.split(".")[:i]) for name in named for i in range(2, name.count(".") + 1)}
    return named | {package for package in passed if not f"{module}.".startswith(f"{package}.")}


def import_graph() -> dict[str, set[str]]:
    graph = {module_name(path): top_level_imports(path) for path in ROOT.rglob("*.py")}
    return {module: {d for d in deps if d in graph and d != module} for module, deps in graph.items()}


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_package_has_no_import_cycle():
    assert cycle_in(import_graph()) is None, " -> ".join(cycle_in(import_graph()))


def test_the_cycle_check_finds_a_cycle():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None
