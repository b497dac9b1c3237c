"""Recipes as YAML files: read with line numbers for every error, written back in a stable form.

A recipe is only ever read with ``yaml.safe_load`` semantics (no Python objects), then validated by the
pydantic models in :mod:`attnsurg.recipe`. An error names the file, the line and the field, e.g.
``recipes/x.yaml:7: steps[0].compress.ratio: Input should be a valid number``.
"""

from __future__ import annotations

import os

from pathlib import Path

import yaml
from pydantic import ValidationError

from attnsurg.errors import UserError
from attnsurg.recipe import Recipe

RECIPE_FILE = "attnsurg_recipe.yaml"


def shipped_dir() -> Path:
    """The shipped recipes: installed as ``attnsurg.recipes`` (from the source tree's ``recipes/``)."""
    try:
        import attnsurg.recipes as shipped

        return Path(next(iter(shipped.__path__)))
    except (ImportError, StopIteration):
        return Path(__file__).resolve().parents[2] / "recipes"


SHIPPED_DIR = shipped_dir()


class DuplicateKey(Exception):
    def __init__(self, key, line: int):
        self.key, self.line = key, line


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping (the second would silently win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML with every setting spelled out (defaults included), so a file records exactly
    what ran even if a later version changes a default."""
    text = yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    return text


def parse_recipe(text: str, name: str = "<recipe>") -> Recipe:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except DuplicateKey as exc:
        raise UserError(f"{name}:{exc.line}: key '{exc.key}' appears twice in one mapping") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{name}:{mark.line + 1}" if mark else name
        detail = " ".join(str(getattr(exc, "problem", None) or exc).split())  # the reader's errors span lines
        raise UserError(f"{where}: not valid YAML ({detail})") from None
    except RecursionError:
        raise UserError(f"{name}: nested too deeply to be a recipe") from None
    if not isinstance(data, dict):
        raise UserError(f"{name}: a recipe is a YAML mapping (model:, output:, steps:, ...)")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = input_path(first["loc"], data)
        if first["type"] == "compress_method":  # a missing or unknown method: point at the step or its key
            loc = input_path(first["loc"][:-1], data)
            method = value_at(data, loc).get("method") if isinstance(value_at(data, loc), dict) else None
            if method is not None:
                loc += ("method",)
                first["msg"] = f"unknown method {method!r}; choose from {first['ctx']['methods']}"
        if first["type"] == "convert_target":  # an unknown target: point at its key
            loc = input_path(first["loc"][:-1], data)
            if isinstance(value_at(data, loc), dict) and "to" in value_at(data, loc):
                first["msg"] = f"unknown target {value_at(data, loc)['to']!r}; choose from {first['ctx']['targets']}"
                loc += ("to",)
        line = line_of(root, loc)
        where = f"{name}:{line}" if line else name
        field = format_loc(loc)
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown key (check its spelling and where it sits)"
        if first["type"] == "missing":
            message = "required key is missing"
        raise UserError(f"{where}: {field + ': ' if field else ''}{message}") from None
    return recipe


def check_output_stays_below(recipe: Recipe, name: str) -> None:
    """A recipe file run as given must not write above the folder it runs from (a shared recipe with
    ``output: ../../x``); an absolute path, or ``-o``, is the user's own choice."""
    output = recipe.output
    if not output.is_absolute() and os.path.normpath(output).split(os.sep)[0] == "..":
        raise UserError(f"{name}: output '{output}' climbs out of the working folder with '..'; pass -o to choose where "
                        "to write")


def load_recipe(path: Path) -> Recipe:
    """A recipe file, or the name of a shipped recipe (``mla-50`` for ``recipes/mla-50.yaml``)."""
    path = resolve_recipe(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; a recipe is a YAML file") from None
    return parse_recipe(text, str(path))


def resolve_recipe(path: Path) -> Path:
    path = Path(path)
    if path.is_file():
        return path
    shipped = SHIPPED_DIR / f"{path.name.removesuffix('.yaml')}.yaml"
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    names = ", ".join(p.stem for p in shipped_recipes()) or "none found"
    raise UserError(f"recipe '{path}' is not a file or a shipped recipe name (shipped: {names})")


def shipped_recipes() -> list[Path]:
    return sorted(SHIPPED_DIR.glob("*.yaml")) if SHIPPED_DIR.is_dir() else []


def input_path(loc: tuple, data) -> tuple:
    """The error location as a path through the YAML input: pydantic adds the tags of discriminated unions
    (``steps.0.compress.compress.tucker.ratio``), which name no key of the file; keep only what does."""
    path, node = [], data
    for i, part in enumerate(loc):
        if not isinstance(node, (dict, list)):
            break  # a scalar: what follows names the types it failed to be
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        elif i < len(loc) - 1:
            continue
        path.append(part)
    return tuple(path)


def value_at(data, loc: tuple):
    for part in loc:
        data = data[part]
    return data


def format_loc(loc: tuple) -> str:
    """``steps[0].convert.kv_budget``; a key that is not a plain name is quoted (``convert['a b']``)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not str(part).isidentifier():
            text += f"[{str(part)!r}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def line_of(node: yaml.Node | None, loc: tuple) -> int | None:
    """1-based line of the deepest node of ``loc`` present in the file (a key's line for a mapping entry)."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            entry = next(((k, v) for k, v in node.value if k.value == part), None)
            if entry is None:
                break
            line, node = entry[0].start_mark.line + 1, entry[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line
