"""`attnsurg assets`: the built-in demo model and texts."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table

from attnsurg.cli.common import JsonFlag, assets_app, examples, out, user_errors
from attnsurg.errors import UserError


@assets_app.callback(invoke_without_command=True)
def assets_default(ctx: typer.Context) -> None:
    """List the built-in assets and whether they are cached (same as `assets list`)."""
    if ctx.invoked_subcommand is None:
        assets_list()


@assets_app.command("list", epilog=examples("attnsurg assets list", "attnsurg assets list --json", guide="models.md"))
def assets_list(json_output: JsonFlag = False) -> None:
    """List the built-in assets with their cache state."""
    from attnsurg.io.assets import asset_table_rows, cache_dir

    rows = asset_table_rows()
    if json_output:
        print(json.dumps({"cache_dir": str(cache_dir()), "assets": rows}, indent=2))
        return
    table = Table(title=f"Built-in assets (cache: {cache_dir()}, override with $ATTNSURG_CACHE)", title_justify="left")
    for column in ("name", "kind", "description", "source", "cached"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(row[c] for c in ("name", "kind", "description", "source", "cached")))
    out.print(table)


@assets_app.command("fetch", epilog=examples("attnsurg assets fetch", "attnsurg assets fetch smollm2-135m wiki-sample",
                                             guide="models.md"))
@user_errors
def assets_fetch(
    names: Annotated[Optional[list[str]], typer.Argument(help="Assets to fetch (default: all but the opt-in ones).")] = None,
) -> None:
    """Fetch built-in assets into the cache (verified by SHA-256)."""
    from attnsurg.io.assets import ASSETS, ensure_demo_model, ensure_text

    for name in names or [name for name, asset in ASSETS.items() if not asset.opt_in]:
        if name not in ASSETS:
            raise UserError(f"unknown asset '{name}'; choose from {', '.join(ASSETS)}")
        path = ensure_demo_model(name) if ASSETS[name].kind == "model" else ensure_text(name)
        out.print(f"{name}: {path}")
