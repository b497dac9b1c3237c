"""`attnsurg convert`: GQA/MHA attention to another form (MLA)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

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
    EvalTokens,
    JsonFlag,
    Overwrite,
    PrintRecipe,
    Seed,
    TrustRemoteCode,
    app,
    calibration_from,
    defaults_of,
    eval_domains_from,
    examples,
    user_errors,
)
from attnsurg.cli.report import execute
from attnsurg.errors import UserError
from attnsurg.recipe import MLA_CALIBRATION, Evaluation, MLASettings

MLA = defaults_of(MLASettings)


@app.command(epilog=examples(
    "attnsurg convert smollm2-135m --to mla --kv-budget 0.5 -o out/mla50",
    "attnsurg convert smollm2-135m --kv-budget 0.25 --dry-run --print-recipe",
    guide="mla.md"))
@user_errors
def convert(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, .gguf, hub id or built-in name.")],
    to: Annotated[str, typer.Option("--to", help="Target attention: mla.", rich_help_panel=PLAN)] = MLA.to,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory.")] = None,
    kv_budget: Annotated[
        Optional[float], typer.Option("--kv-budget", help="Share of the KV cache kept per token (default 0.5).",
                                      rich_help_panel=PLAN)
    ] = MLA.kv_budget,
    kv_rank: Annotated[Optional[int], typer.Option("--kv-rank", help="Latent rank (instead of --kv-budget).",
                                                   rich_help_panel=PLAN)] = MLA.kv_rank,
    rope_dim: Annotated[Optional[int], typer.Option("--rope-dim", help="Dims of the shared RoPE key (even, <= head dim).",
                                                    rich_help_panel=PLAN)] = MLA.rope_dim,
    rope_layout: Annotated[
        str,
        typer.Option("--rope-layout", help="standard or flexible.", rich_help_panel=PLAN),
    ] = MLA.rope_layout,
    rope_fold: Annotated[
        Optional[int],
        typer.Option("--rope-fold", help="Neighbouring frequencies per RoPE pair (FreqFold).", rich_help_panel=PLAN),
    ] = MLA.rope_fold,
    split: Annotated[
        str,
        typer.Option("--split", help="RoPE width: rule, or measured.", rich_help_panel=PLAN),
    ] = MLA.split,
    format: Annotated[
        str,
        typer.Option("--format", help="native (engines) or exact.", rich_help_panel=PLAN),
    ] = MLA.format,
    nope_width: Annotated[
        str,
        typer.Option("--nope-width", help="No-RoPE q/k width: latent or head.", rich_help_panel=PLAN),
    ] = MLA.nope_width,
    engine: Annotated[
        Optional[str],
        typer.Option("--engine", help="transformers|llama.cpp|vllm|sglang: checked, laid out.",
                     rich_help_panel=PLAN),
    ] = MLA.engine,
    calib_dataset: CalibDataset = MLA_CALIBRATION.data.dataset,
    calib_text: CalibText = None,
    calib_tokens: CalibTokens = MLA_CALIBRATION.tokens,
    calib_seq_len: CalibSeqLen = MLA_CALIBRATION.seq_len,
    weighted: Annotated[
        bool, typer.Option("--weighted/--unweighted", help="Consumer-weighted or plain.",
                           rich_help_panel=CALIBRATION)
    ] = MLA.weighted,
    token_weights: Annotated[
        str, typer.Option("--token-weights", help="uniform or received attention.", rich_help_panel=CALIBRATION)
    ] = MLA.token_weights,
    refine_steps: Annotated[
        int, typer.Option("--refine-steps", help="Adam steps per layer (0: off).",
                          rich_help_panel=CALIBRATION)
    ] = MLA.refine_steps,
    refine_tokens: Annotated[
        Optional[int], typer.Option("--refine-tokens", help="Tokens refined on (default: the first half).",
                                    rich_help_panel=CALIBRATION)
    ] = MLA.refine_tokens,
    refine_lr: Annotated[float, typer.Option("--refine-lr", help="Refinement peak learning rate.",
                                             rich_help_panel=CALIBRATION)] = MLA.refine_lr,
    refine_schedule: Annotated[
        str, typer.Option("--refine-schedule", help="constant or cosine (to 1/10).",
                          rich_help_panel=CALIBRATION)
    ] = MLA.refine_schedule,
    short_prompts: Annotated[
        float, typer.Option("--short-prompts", help="Window share cut to short prompts.", rich_help_panel=CALIBRATION)
    ] = MLA.short_prompts,
    stream: Annotated[
        Optional[bool], typer.Option("--stream/--no-stream", help="One source layer in memory (default: when possible).",
                                     rich_help_panel=PLAN)
    ] = MLA.stream,
    eval_tokens: EvalTokens = Evaluation().tokens,
    eval_domains: EvalDomains = DEFAULT_EVAL_DOMAINS,
    dry_run: DryRun = False,
    print_recipe: PrintRecipe = False,
    overwrite: Overwrite = False,
    seed: Seed = 0,
    device: Device = "auto",
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Convert GQA/MHA attention to MLA and write a new checkpoint."""
    from attnsurg.api import surgery_recipe
    from attnsurg.recipe import ConvertStep
    from attnsurg.requests import ModelRef

    if to != "mla":
        raise UserError(f"--to {to} is not supported; available: mla")
    if output is None and not dry_run:
        raise UserError("missing --output/-o: the directory to write the converted checkpoint to")
    settings = MLASettings(
        kv_budget=kv_budget,
        kv_rank=kv_rank,
        rope_dim=rope_dim,
        rope_layout=rope_layout,
        rope_fold=rope_fold,
        split=split,
        format=format,
        engine=engine,
        nope_width=nope_width,
        weighted=weighted,
        token_weights=token_weights,
        refine_steps=refine_steps,
        refine_tokens=refine_tokens,
        refine_lr=refine_lr,
        refine_schedule=refine_schedule,
        short_prompts=short_prompts,
        stream=stream,
    )
    reference = ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    recipe = surgery_recipe(reference, output or Path("OUT"), ConvertStep(convert=settings),  # a dry run writes nothing
                            calibration_from(calib_dataset, calib_text, calib_tokens, calib_seq_len), None, eval_tokens,
                            eval_domains_from(eval_domains), seed)
    execute(recipe, dry_run, overwrite, print_recipe, json_output, device)
