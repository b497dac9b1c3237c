"""`attnsurg convert`: GQA/MHA attention to another form (MLA, or hybrid linear attention).

Each target's options are handed to its settings class only when given on the command line, so an option of
another target is refused and the rest take the settings' own defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attnsurg.cli.common import (
    CALIBRATION,
    given_on_command_line,
    DEFAULT_EVAL_DOMAINS,
    PLAN,
    Device,
    AllowPickle,
    CalibDataset,
    CalibSeqLen,
    CalibText,
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
    defaults_of,
    eval_domains_from,
    examples,
    user_errors,
)
from attnsurg.cli.report import execute
from attnsurg.errors import UserError
from attnsurg.methods.linear.settings import LINEAR_CALIBRATION_TOKENS, LinearSettings
from attnsurg.recipe import Evaluation
from attnsurg.methods.mla.settings import MLA_CALIBRATION, MLASettings

MLA = defaults_of(MLASettings)
LINEAR = defaults_of(LinearSettings)
SETTINGS_OPTIONS = {  # parameter -> its flag, for every option a target's settings read
    "kv_budget": "--kv-budget", "kv_rank": "--kv-rank", "rope_dim": "--rope-dim", "rope_layout": "--rope-layout",
    "rope_fold": "--rope-fold", "split": "--split", "format": "--format", "engine": "--engine",
    "nope_width": "--nope-width", "weighted": "--weighted/--unweighted", "token_weights": "--token-weights",
    "refine_steps": "--refine-steps", "refine_tokens": "--refine-tokens", "refine_lr": "--refine-lr",
    "refine_schedule": "--refine-schedule", "short_prompts": "--short-prompts", "stream": "--stream/--no-stream",
    "window": "--window", "sinks": "--sinks", "feature_map": "--feature-map", "feature_dim": "--feature-dim", "transfer_steps": "--transfer-steps",
    "transfer_lr": "--transfer-lr", "decay": "--decay/--no-decay", "features_before_rope": "--features-before-rope/--features-after-rope",
    "full_layers": "--full-layers", "retrieval_layers": "--retrieval-layers",
}
# Hidden from --help so it fits one screen (docs/mla.md and docs/linear.md describe them): --weighted,
# --token-weights and --refine-schedule, measured no better than their defaults on either real model, and
# --transfer-lr, --sinks, --feature-map (performer: the data-free baseline), --decay, --features-before-rope,
# --full-layers and --retrieval-layers.


@app.command(epilog=examples(
    "attnsurg convert smollm2-135m --to mla --kv-budget 0.5 -o out/mla50",
    "attnsurg convert smollm2-135m --to linear -o out/linear256",
    guide="mla.md"))
@user_errors
def convert(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, .gguf, hub id or built-in name.")],
    ctx: typer.Context,
    to: Annotated[str, typer.Option("--to", help="mla or linear.", rich_help_panel=PLAN)] = MLA.to,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory.")] = None,
    kv_budget: Annotated[
        Optional[float], typer.Option("--kv-budget", help="KV cache share kept (default 0.5).",
                                      rich_help_panel=PLAN)
    ] = MLA.kv_budget,
    kv_rank: Annotated[Optional[int], typer.Option("--kv-rank", help="Latent rank (not --kv-budget).",
                                                   rich_help_panel=PLAN)] = MLA.kv_rank,
    rope_dim: Annotated[Optional[int], typer.Option("--rope-dim", help="Shared RoPE key dims (even).",
                                                    rich_help_panel=PLAN)] = MLA.rope_dim,
    rope_layout: Annotated[
        str,
        typer.Option("--rope-layout", help="standard or flexible.", rich_help_panel=PLAN),
    ] = MLA.rope_layout,
    rope_fold: Annotated[
        Optional[int],
        typer.Option("--rope-fold", help="Frequencies per pair (FreqFold).", rich_help_panel=PLAN),
    ] = MLA.rope_fold,
    split: Annotated[
        str,
        typer.Option("--split", help="RoPE width: rule or measured.", rich_help_panel=PLAN),
    ] = MLA.split,
    format: Annotated[
        str,
        typer.Option("--format", help="native (engines) or exact.", rich_help_panel=PLAN),
    ] = MLA.format,
    nope_width: Annotated[
        str,
        typer.Option("--nope-width", help="No-RoPE width: latent or head.", rich_help_panel=PLAN),
    ] = MLA.nope_width,
    engine: Annotated[
        Optional[str],
        typer.Option("--engine", help="transformers, llama.cpp, vllm, sglang.",
                     rich_help_panel=PLAN),
    ] = MLA.engine,
    calib_dataset: CalibDataset = MLA_CALIBRATION.data.dataset,
    calib_text: CalibText = None,
    calib_tokens: Annotated[Optional[int], typer.Option(
        "--calib-tokens", help=f"Calibration tokens (mla: {MLA_CALIBRATION.tokens}, linear: "
        f"{LINEAR_CALIBRATION_TOKENS}).", rich_help_panel=CALIBRATION)] = None,
    calib_seq_len: CalibSeqLen = MLA_CALIBRATION.seq_len,
    weighted: Annotated[
        bool, typer.Option("--weighted/--unweighted", help="Consumer-weighted or plain.",
                           hidden=True, rich_help_panel=CALIBRATION)
    ] = MLA.weighted,
    token_weights: Annotated[
        str, typer.Option("--token-weights", help="uniform or received attention.", hidden=True, rich_help_panel=CALIBRATION)
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
                          hidden=True, rich_help_panel=CALIBRATION)
    ] = MLA.refine_schedule,
    short_prompts: Annotated[
        float, typer.Option("--short-prompts", help="Window share cut to short prompts.", rich_help_panel=CALIBRATION)
    ] = MLA.short_prompts,
    stream: Annotated[
        Optional[bool], typer.Option("--stream/--no-stream", help="One layer in memory (default: if possible).",
                                     rich_help_panel=PLAN)
    ] = MLA.stream,
    window: Annotated[int, typer.Option("--window", help="Keys of exact attention.",
                                        rich_help_panel=PLAN)] = LINEAR.window,
    sinks: Annotated[int, typer.Option("--sinks", help="First keys of a sequence kept exact (attention sinks).",
                                       hidden=True)] = LINEAR.sinks,
    feature_map: Annotated[str, typer.Option("--feature-map", help="hedgehog (learned) or performer (random, data-free).",
                                             hidden=True)] = LINEAR.feature_map,
    feature_dim: Annotated[Optional[int], typer.Option("--feature-dim", help="Feature width (default: head dim).",
                                                       rich_help_panel=PLAN)] = LINEAR.feature_dim,
    transfer_steps: Annotated[Optional[int], typer.Option(
        "--transfer-steps", help="Transfer steps per layer (default 300).",
        rich_help_panel=PLAN)] = LINEAR.transfer_steps,
    transfer_lr: Annotated[float, typer.Option("--transfer-lr", help="Attention-transfer learning rate.",
                                               hidden=True, rich_help_panel=PLAN)] = LINEAR.transfer_lr,
    decay: Annotated[Optional[bool], typer.Option("--decay/--no-decay", help="The linear part fades with distance (learned).",
                                                  hidden=True)] = LINEAR.decay,
    features_before_rope: Annotated[Optional[bool], typer.Option("--features-before-rope/--features-after-rope",
                                                       help="Feature maps read q, k before RoPE (no position).",
                                                       hidden=True)] = LINEAR.features_before_rope,
    full_layers: Annotated[Optional[str], typer.Option("--full-layers", help="Layers that keep softmax attention over the whole context (e.g. 3,7).",
                                                       hidden=True)] = None,
    retrieval_layers: Annotated[int, typer.Option("--retrieval-layers", help="Layers kept as softmax attention, chosen by long-range copying.",
                                                  hidden=True)] = LINEAR.retrieval_layers,
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
    """Convert attention to MLA or hybrid linear attention; write a new checkpoint."""
    from attnsurg.api import surgery_recipe
    from attnsurg.methods.base import method_for
    from attnsurg.recipe import ConvertStep
    from attnsurg.requests import ModelRef

    if output is None and not dry_run:
        raise UserError("missing --output/-o: the directory to write the converted checkpoint to")
    given = {name: value for name, value in locals().items() if name in SETTINGS_OPTIONS and given_on_command_line(ctx, name)}
    settings = target_settings(to, given)
    if calib_tokens is None:
        calib_tokens = method_for(settings).calibration.tokens
    reference = ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    recipe = surgery_recipe(reference, output or Path("OUT"), ConvertStep(convert=settings),  # a dry run writes nothing
                            calibration_from(calib_dataset, calib_text, calib_tokens, calib_seq_len), None, eval_tokens,
                            eval_domains_from(eval_domains), seed, eval_long)
    execute(recipe, dry_run, overwrite, print_recipe, json_output, device)


def target_settings(to: str, given: dict):
    """The target's settings from the options given; an option the target does not take is an error."""
    from attnsurg.methods.base import convert_target_names, settings_for_target

    settings = settings_for_target(to)
    if settings is None:
        raise UserError(f"--to {to} is not available; choose from {', '.join(convert_target_names())}")
    refused = [SETTINGS_OPTIONS[name] for name in given if not settings.accepts(name)]
    if refused:
        raise UserError(f"{', '.join(refused)} {'does' if len(refused) == 1 else 'do'} not apply to --to {to}")
    return settings.model_validate({"to": to, **given})
