"""`attnsurg convert`: GQA/MHA attention to another form (MLA)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attnsurg.cli.common import (
    Device,
    DEFAULT_EVAL_DOMAINS,
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
    user_errors,
)
from attnsurg.cli.report import execute
from attnsurg.errors import UserError
from attnsurg.recipe import ConvertMLA

MLA = defaults_of(ConvertMLA)


@app.command()
@user_errors
def convert(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, .gguf file, hub id or built-in name.")],
    to: Annotated[str, typer.Option("--to", help="Target attention: mla.")] = MLA.to,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory.")] = None,
    kv_budget: Annotated[
        Optional[float], typer.Option("--kv-budget", help="Fraction of the original KV cache per token (default 0.5).")
    ] = MLA.kv_budget,
    kv_rank: Annotated[Optional[int], typer.Option("--kv-rank", help="Latent rank (instead of --kv-budget).")] = MLA.kv_rank,
    rope_dim: Annotated[Optional[int], typer.Option("--rope-dim", help="Dims of the shared RoPE key (even, <= head dim).")] = MLA.rope_dim,
    rope_layout: Annotated[
        str,
        typer.Option("--rope-layout", help="standard (every engine) or flexible (any frequency, repeats; transformers only)."),
    ] = MLA.rope_layout,
    rope_fold: Annotated[
        Optional[int],
        typer.Option("--rope-fold", help="Neighbouring frequencies sharing one RoPE pair (FreqFold, standard layout). "
                     "Default: as many as spread the pairs over every frequency (1 at 0.5, 2 at 0.25 for head dim 64)."),
    ] = MLA.rope_fold,
    format: Annotated[
        str,
        typer.Option("--format", help="native (no biases, the latent norm fitted: llama.cpp, vLLM, SGLang, transformers) "
                     "or exact (full budget reproduces the source; transformers only)."),
    ] = MLA.format,
    nope_width: Annotated[
        str,
        typer.Option("--nope-width", help="latent (default: each head's no-RoPE query and key as wide as the latent, "
                     "headroom refinement uses) or head (head_dim wide: the same closed form, far fewer parameters, "
                     "e.g. Llama-3.1-8B at 0.5: 62M instead of 185M attention parameters per layer)."),
    ] = MLA.nope_width,
    engine: Annotated[
        Optional[str],
        typer.Option("--engine", help="transformers, llama.cpp, vllm or sglang: refuse, with the reason, a plan that "
                     "engine's DeepSeek path would not run, and lay the checkpoint out for it (vllm: head dims "
                     "zero-padded to its kernel shapes, lm_head untied)."),
    ] = MLA.engine,
    calib_dataset: CalibDataset = "all",
    calib_text: CalibText = None,
    calib_tokens: CalibTokens = 4096,
    calib_seq_len: CalibSeqLen = 512,
    weighted: Annotated[
        bool, typer.Option("--weighted/--unweighted", help="Fit the latent by PCA weighted by what consumes "
                           "it (queries for keys, W_o for values), or plain PCA.")
    ] = MLA.weighted,
    token_weights: Annotated[
        str, typer.Option("--token-weights", help="uniform, or received: fit the cache on calibration tokens weighted "
                          "by the attention they receive (the sink most).")
    ] = MLA.token_weights,
    refine_steps: Annotated[
        int, typer.Option("--refine-steps", help="Adam steps per layer (128 query positions of one calibration window each) against the original layer's output (0: closed form only).")
    ] = MLA.refine_steps,
    refine_tokens: Annotated[
        Optional[int], typer.Option("--refine-tokens", help="Calibration tokens used for refinement (default: the first 2048).")
    ] = MLA.refine_tokens,
    refine_lr: Annotated[float, typer.Option("--refine-lr", help="Refinement learning rate (the peak, with cosine).")] = MLA.refine_lr,
    refine_schedule: Annotated[
        str, typer.Option("--refine-schedule", help="constant, or cosine (decays to a tenth; pays on long refinements).")
    ] = MLA.refine_schedule,
    short_prompts: Annotated[
        float, typer.Option("--short-prompts", help="Share of each calibration window (its end) cut into prompts of "
                            "8-128 tokens of their own (positions restart). Off by default: 0.25 lost short factual "
                            "answers on the demo model.")
    ] = MLA.short_prompts,
    stream: Annotated[
        bool, typer.Option("--stream", help="One source layer in memory at a time, written straight to the "
                           "output (models larger than memory; needs a local safetensors directory; nothing scored).")
    ] = MLA.stream,
    eval_tokens: EvalTokens = MLA.eval_tokens,
    eval_domains: EvalDomains = DEFAULT_EVAL_DOMAINS,
    dry_run: DryRun = False,
    print_recipe: PrintRecipe = False,
    overwrite: Overwrite = MLA.overwrite,
    seed: Seed = MLA.seed,
    device: Device = MLA.device,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Convert attention to another form and write a new checkpoint (GQA/MHA -> MLA)."""
    from attnsurg.recipe import ModelRef, Recipe

    if to != "mla":
        raise UserError(f"--to {to} is not supported; available: mla")
    if output is None and not dry_run:
        raise UserError("missing --output/-o: the directory to write the converted checkpoint to")
    request = ConvertMLA(
        model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle),
        output=output or Path("OUT"),  # a dry run writes nothing
        kv_budget=kv_budget,
        kv_rank=kv_rank,
        rope_dim=rope_dim,
        rope_layout=rope_layout,
        rope_fold=rope_fold,
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
        calibration=calibration_from(calib_dataset, calib_text, calib_tokens, calib_seq_len),
        eval_tokens=eval_tokens,
        eval_domains=eval_domains_from(eval_domains),
        overwrite=overwrite,
        seed=seed,
    )
    execute(Recipe.from_request(request), dry_run, overwrite, print_recipe, json_output, device)
