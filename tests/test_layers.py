"""docs/architecture.md's layers: a module's top-level imports reach its own layer or the ones below it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "attnsurg"
LAYERS = [  # from the top, as docs/architecture.md lists them
    {"cli", "api", "__main__", "__init__"},
    {"pipelines", "analyze", "heal", "generate"},
    {"eval", "info"},
    {"methods"},
    {"calibrate", "heads", "sparsity", "linalg", "placement", "data", "distillation", "adapters", "io", "arch", "modeling"},
    {"recipe", "requests", "errors", "ui", "recipes"},
]


def layer_of(name: str) -> int:
    return next(i for i, members in enumerate(LAYERS) if name in members)


def top_level_imports(path: Path) -> list[str]:
    """The attnsurg modules a file imports at its top level (imports inside functions are left out)."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attnsurg"):
            parts = node.module.split(".")
            names += [parts[1]] if len(parts) > 1 else [a.name for a in node.names if a.name != "__version__"]
        elif isinstance(node, ast.Import):
            names += [a.name.split(".")[1] for a in node.names if a.name.startswith("attnsurg.")]
    return names


def test_every_module_imports_its_own_layer_or_below():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for name in top_level_imports(path):
            if layer_of(name) < layer_of(own):
                upward.append(f"{path.relative_to(PACKAGE)} imports attnsurg.{name}")
    assert not upward, upward


def test_every_top_level_module_has_a_layer():
    names = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert all(any(name in members for members in LAYERS) for name in names), names
