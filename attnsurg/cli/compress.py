"""`attnsurg compress`: low-rank, tensor-decomposed or top-k attention.

The options are every method's settings side by side; a method takes the ones its settings class accepts
(``CompressSettings.accepts``) and its defaults fill the rest, so a given option is refused by a method it does
not apply to and the command runs what a recipe leaving the same keys out runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from attnsurg.cli.common import (
    CALIBRATION,
    DEFAULT_EVAL_DOMAINS,
    PLAN,
    Device,
    AllowPickle,
    CalibDataset,
    CalibSeqLen,
    CalibText,
    CalibTokens,
    DryRun,
    EvalDomains,
    EvalLong,
    EvalTokens,
    JsonFlag,
    Overwrite,
    PrintRecipe,
    Seed,
    TrustRemoteCode,
    app,
    calibration_from,
    eval_domains_from,
    examples,
    user_errors,
)
from attnsurg.cli.report import execute
from attnsurg.errors import UserError
from attnsurg.recipe import Evaluation
from attnsurg.requests import COMMAND_CALIBRATION

DEFAULT_METHOD = "svdllm"
FLAGS = {"targets": "--targets", "ratio": "--ratio", "rank": "--rank", "ranks": "--ranks", "top_k": "--top-k",
         "basis": "--basis", "variance": "--variance", "kv_latent": "--kv-latent", "allocate": "--allocate",
         "weighted": "--weighted/--unweighted", "stacked": "--stacked", "stream": "--stream/--no-stream"}


class CompressCommand(TyperCommand):
    """Lists the methods in ``--method``'s help, from the catalog (no method, and no torch, is imported)."""

    def format_help(self, ctx, formatter) -> None:
        from attnsurg.methods.catalog import names

        method = next(param for param in self.params if param.name == "method")
        method.help = f"{', '.join(names('compress'))}."
        super().format_help(ctx, formatter)


@app.command(cls=CompressCommand, epilog=examples(
    "attnsurg compress smollm2-135m --method svdllm --ratio 0.5 -o out/svdllm50",
    "attnsurg compress smollm2-135m --targets k,v --kv-latent --rank 64 -o out/kv",
    "attnsurg compress smollm2-135m --method tucker --ratio 0.5 -o out/tucker50",
    "attnsurg compress smollm2-135m -m loki --rank 32 --top-k 0.25 -o out/loki",
    guide="compress.md (loki: docs/loki.md)"))
@user_errors
def compress(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, .gguf, hub id or built-in name.")],
    method: Annotated[str, typer.Option("--method", "-m", help="The method.", rich_help_panel=PLAN)] = DEFAULT_METHOD,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory.")] = None,
    targets: Annotated[Optional[str], typer.Option("--targets", help="Projections to factorize, from q,k,v,o (default all).",
                                                   rich_help_panel=PLAN)] = None,
    ratio: Annotated[Optional[float], typer.Option("--ratio", help="Share of parameters kept (default 0.5).",
                                                   rich_help_panel=PLAN)] = None,
    rank: Annotated[Optional[int], typer.Option("--rank", help="One rank for every projection (instead of --ratio).",
                                                rich_help_panel=PLAN)] = None,
    ranks: Annotated[Optional[str], typer.Option("--ranks", help="Tucker ranks heads,head_dim,hidden (or --ratio).",
                                                 rich_help_panel=PLAN)] = None,
    top_k: Annotated[Optional[str], typer.Option("--top-k", help="Top-k methods: keys kept per query, a count or a share.",
                                                 rich_help_panel=PLAN)] = None,
    basis: Annotated[Optional[str], typer.Option("--basis", help="Loki: PCA of post-rope (default) or pre-rope keys.",
                                                 rich_help_panel=PLAN)] = None,
    variance: Annotated[Optional[float], typer.Option("--variance", help="Loki: ranks keeping this share of key variance.",
                                                      rich_help_panel=PLAN)] = None,
    kv_latent: Annotated[Optional[bool], typer.Option("--kv-latent", help="k and v share one cached latent (--targets k,v).",
                                                      rich_help_panel=PLAN)] = None,
    allocate: Annotated[Optional[bool], typer.Option("--allocate", help="Spread the budget by truncation energy.",
                                                     rich_help_panel=PLAN)] = None,
    weighted: Annotated[Optional[bool], typer.Option("--weighted/--unweighted",
                                                     help="Consumer-weighted (default on: svdllm, tucker, cp).",
                                                     rich_help_panel=CALIBRATION)] = None,
    stacked: Annotated[Optional[bool], typer.Option("--stacked", help="Tucker: q, k, v, o of a layer in one tensor.",
                                                    rich_help_panel=PLAN)] = None,
    stream: Annotated[Optional[bool], typer.Option("--stream/--no-stream",
                                                   help="One source layer in memory (default: when possible).",
                                                   rich_help_panel=PLAN)] = None,
    calib_dataset: CalibDataset = COMMAND_CALIBRATION.data.dataset,
    calib_text: CalibText = None,
    calib_tokens: CalibTokens = COMMAND_CALIBRATION.tokens,
    calib_seq_len: CalibSeqLen = COMMAND_CALIBRATION.seq_len,
    eval_tokens: EvalTokens = Evaluation().tokens,
    eval_domains: EvalDomains = DEFAULT_EVAL_DOMAINS,
    eval_long: EvalLong = 0,
    dry_run: DryRun = False,
    print_recipe: PrintRecipe = False,
    overwrite: Overwrite = False,
    seed: Seed = 0,
    device: Device = "auto",
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Compress attention (low rank, tensor or top-k) and write a new checkpoint."""
    from attnsurg.api import surgery_recipe
    from attnsurg.recipe import CompressStep
    from attnsurg.requests import ModelRef

    given = {name: value for name, value in locals().items() if name in FLAGS and value is not None}
    if output is None and not dry_run:
        raise UserError("missing --output/-o: the directory to write the compressed checkpoint to")
    step = CompressStep(compress=method_settings(method, given))
    reference = ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    recipe = surgery_recipe(reference, output or Path("OUT"), step,  # a dry run writes nothing
                            calibration_from(calib_dataset, calib_text, calib_tokens, calib_seq_len), None, eval_tokens,
                            eval_domains_from(eval_domains), seed, eval_long)
    execute(recipe, dry_run, overwrite, print_recipe, json_output, device)


def method_settings(method: str, given: dict):
    """The method's settings from the options given; an option the method does not take is an error."""
    from attnsurg.methods.base import compress_method_names, settings_for_method

    settings = settings_for_method(method)
    if settings is None:
        raise UserError(f"--method {method} is not available; choose from {', '.join(compress_method_names())}")
    refused = [FLAGS[name] for name in given if not settings.accepts(name)]
    if refused:
        raise UserError(f"{', '.join(refused)} {'does' if len(refused) == 1 else 'do'} not apply to --method {method}")
    return settings.model_validate({"method": method, **given})
