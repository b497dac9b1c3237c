"""`attnsurg run` and `attnsurg recipe ...`: YAML recipes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from attnsurg.cli.common import (
    Device,
    AllowPickle,
    DryRun,
    JsonFlag,
    Overwrite,
    TrustRemoteCode,
    app,
    examples,
    out,
    print_error,
    recipe_app,
    user_errors,
)
from attnsurg.cli.report import execute
from attnsurg.errors import UserError


@app.command(epilog=examples("attnsurg run mla-50 -o out/mla50-recipe", "attnsurg run tucker-50 --dry-run",
                             guide="recipes.md"))
@user_errors
def run(
    recipe_path: Annotated[Path, typer.Argument(metavar="RECIPE", help="A recipe file or a shipped recipe's name.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write here instead of the recipe's output.")] = None,
    dry_run: DryRun = False,
    overwrite: Overwrite = False,
    device: Device = "auto",
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Run a YAML recipe: surgery, optional healing, evaluation, checkpoint."""
    from attnsurg.io.recipe_file import check_output_stays_below, load_recipe
    from attnsurg.pipelines.run import check_permissions

    recipe = load_recipe(recipe_path)
    if output is not None:
        recipe = recipe.model_copy(update={"output": output})
    else:
        check_output_stays_below(recipe, str(recipe_path))
    check_permissions(recipe, trust_remote_code, allow_pickle)
    execute(recipe, dry_run, overwrite, print_recipe=False, json_output=json_output, device=device)



@recipe_app.command("validate", epilog=examples("attnsurg recipe validate mla-50",
                                                "attnsurg recipe validate recipes/*.yaml", guide="recipes.md"))
@user_errors
def recipe_validate(
    paths: Annotated[list[Path], typer.Argument(metavar="RECIPE...", help="Recipe files or shipped names.")],
) -> None:
    """Check recipes without running them (exit code 2 when any fails)."""
    from attnsurg.io.recipe_file import check_output_stays_below, load_recipe, resolve_recipe
    from attnsurg.pipelines.run import run_recipe

    failed = []
    for path in paths:
        try:
            recipe = load_recipe(path)
            name = str(resolve_recipe(path))
            check_output_stays_below(recipe, name)
            if recipe.surgery is not None and model_on_this_machine(recipe.model.ref):  # heal-only: its teacher too
                try:
                    run_recipe(recipe, dry_run=True)
                except UserError as exc:  # the dry run's checks do not know the file
                    raise UserError(f"{name}: {exc}") from None
        except UserError as exc:
            print_error(str(exc))
            failed.append(path)
            continue
        kinds = " -> ".join(recipe_step_label(step) for step in recipe.steps)
        out.print(f"{resolve_recipe(path)}: ok ({recipe.model.ref}: {kinds} -> {recipe.output})", highlight=False)
    if failed:
        raise typer.Exit(UserError.exit_code)


def model_on_this_machine(ref: str) -> bool:
    """A local checkpoint, or a built-in model already in the cache: its config is read without a fetch."""
    from attnsurg.io.assets import ASSETS, is_cached

    return is_cached(ASSETS[ref]) if ref in ASSETS else Path(ref).exists()


def recipe_step_label(step) -> str:
    from attnsurg.recipe import step_kind

    kind = step_kind(step)
    settings = getattr(step, kind)
    if kind == "convert":
        from attnsurg.methods.base import method_for

        return method_for(settings).step_label(settings)
    if kind == "compress":
        budget = {name: getattr(settings, name, None) for name in ("ratio", "rank", "ranks", "top_k")}
        shown = ", ".join(f"{name} {value}" for name, value in budget.items() if value is not None)
        latent = ", k/v latent" if getattr(settings, "kv_latent", False) else ""
        latent += ", stacked q,k,v,o" if getattr(settings, "stacked", False) else ""
        return f"compress {settings.method} ({shown or 'default budget'}{latent})"
    return f"heal ({settings.tokens:,} tokens)"


@recipe_app.command("list", epilog=examples("attnsurg recipe list", "attnsurg recipe list --json", guide="recipes.md"))
@user_errors
def recipe_list(json_output: JsonFlag = False) -> None:
    """The recipes that ship with attnsurg: name, what they do, their steps."""
    from attnsurg.io.recipe_file import SHIPPED_DIR, load_recipe, shipped_recipes

    rows = []
    for path in shipped_recipes():
        recipe = load_recipe(path)
        rows.append({"name": path.stem, "description": recipe.description, "model": recipe.model.ref,
                     "steps": " -> ".join(recipe_step_label(step) for step in recipe.steps), "path": str(path)})
    if json_output:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        out.print(f"no shipped recipes found in {SHIPPED_DIR}")
        return
    table = Table(title=f"Shipped recipes ({SHIPPED_DIR}); run one with `attnsurg run NAME -o OUT`", title_justify="left")
    for column in ("name", "description", "model", "steps"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], row["description"], row["model"], row["steps"])
    out.print(table)
