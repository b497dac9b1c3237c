"""`attnsurg compress`: low-rank, tensor-decomposed or top-k attention."""

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
from attnsurg.recipe import COMMAND_CALIBRATION, CompressHeadTensor, CompressLoki, CompressLowRank

LOW_RANK_METHODS = ("svd", "asvd", "svdllm")
TENSOR_METHODS = ("tucker", "cp")
SPARSE_METHODS = ("loki",)
LOWRANK, TENSOR, LOKI = (defaults_of(settings) for settings in (CompressLowRank, CompressHeadTensor, CompressLoki))


@app.command(epilog=examples(
    "attnsurg compress smollm2-135m --method svdllm --ratio 0.5 -o out/svdllm50",
    "attnsurg compress smollm2-135m --targets k,v --kv-latent --rank 64 -o out/kv",
    "attnsurg compress smollm2-135m --method tucker --ratio 0.5 -o out/tucker50",
    "attnsurg compress smollm2-135m -m loki --rank 32 --top-k 0.25 -o out/loki",
    guide="compress.md (loki: docs/loki.md)"))
@user_errors
def compress(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, .gguf, hub id or built-in name.")],
    method: Annotated[
        str, typer.Option("--method", "-m", help="svd, asvd, svdllm, tucker, cp or loki (top-k).", rich_help_panel=PLAN)
    ] = "svdllm",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory.")] = None,
    targets: Annotated[str, typer.Option("--targets", help="Projections to factorize, from q,k,v,o.",
                                         rich_help_panel=PLAN)] = "q,k,v,o",
    ratio: Annotated[
        Optional[float],
        typer.Option("--ratio", help="Share of the targeted parameters kept, in (0, 1].", rich_help_panel=PLAN),
    ] = LOWRANK.ratio,
    rank: Annotated[
        Optional[int], typer.Option("--rank", help="One rank for every projection (instead of --ratio).",
                                    rich_help_panel=PLAN)
    ] = LOWRANK.rank,
    ranks: Annotated[
        Optional[str], typer.Option("--ranks", help="Tucker ranks heads,head_dim,hidden (or --ratio).",
                                    rich_help_panel=PLAN)
    ] = TENSOR.ranks,
    top_k: Annotated[
        Optional[str], typer.Option("--top-k", help="Loki: keys kept per query, a count or a share.",
                                    rich_help_panel=PLAN)
    ] = LOKI.top_k,
    basis: Annotated[str, typer.Option("--basis", help="Loki: PCA of post-rope or pre-rope keys.",
                                       rich_help_panel=PLAN)] = LOKI.basis,
    variance: Annotated[
        Optional[float],
        typer.Option("--variance", help="Loki: ranks keeping this share of key variance.", rich_help_panel=PLAN),
    ] = LOKI.variance,
    kv_latent: Annotated[
        bool, typer.Option("--kv-latent", help="k and v share one cached latent (--targets k,v).", rich_help_panel=PLAN)
    ] = LOWRANK.kv_latent,
    allocate: Annotated[
        bool, typer.Option("--allocate", help="Spread the budget by truncation energy.", rich_help_panel=PLAN)
    ] = LOWRANK.allocate,
    weighted: Annotated[
        Optional[bool],
        typer.Option("--weighted/--unweighted", help="Consumer-weighted (default on: svdllm, tucker, cp).",
                     rich_help_panel=CALIBRATION),
    ] = None,
    stacked: Annotated[
        bool, typer.Option("--stacked", help="Tucker: q, k, v, o of a layer in one tensor.", rich_help_panel=PLAN)
    ] = TENSOR.stacked,
    stream: Annotated[
        bool, typer.Option("--stream", help="One layer in memory at a time (local safetensors).", rich_help_panel=PLAN)
    ] = LOWRANK.stream,
    calib_dataset: CalibDataset = COMMAND_CALIBRATION.data.dataset,
    calib_text: CalibText = None,
    calib_tokens: CalibTokens = COMMAND_CALIBRATION.tokens,
    calib_seq_len: CalibSeqLen = COMMAND_CALIBRATION.seq_len,
    eval_tokens: EvalTokens = LOWRANK.eval_tokens,
    eval_domains: EvalDomains = DEFAULT_EVAL_DOMAINS,
    dry_run: DryRun = False,
    print_recipe: PrintRecipe = False,
    overwrite: Overwrite = LOWRANK.overwrite,
    seed: Seed = LOWRANK.seed,
    device: Device = LOWRANK.device,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Compress attention (low rank, tensor or top-k) and write a new checkpoint."""
    from attnsurg.methods.lowrank import parse_targets
    from attnsurg.recipe import ModelRef, Recipe

    methods = LOW_RANK_METHODS + TENSOR_METHODS + SPARSE_METHODS
    if method not in methods:
        raise UserError(f"--method {method} is not available; choose from {', '.join(methods)}")
    if output is None and not dry_run:
        raise UserError("missing --output/-o: the directory to write the compressed checkpoint to")
    common = dict(
        model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle),
        output=output or Path("OUT"),  # a dry run writes nothing
        method=method,
        targets=parse_targets(targets),
        ratio=ratio,
        calibration=calibration_from(calib_dataset, calib_text, calib_tokens, calib_seq_len),
        eval_tokens=eval_tokens,
        eval_domains=eval_domains_from(eval_domains),
        overwrite=overwrite,
        seed=seed,
    )
    if method in SPARSE_METHODS:
        from attnsurg.methods.loki import parse_top_k

        reject_options(method, {"--kv-latent": kv_latent, "--allocate": allocate, "--ratio": ratio is not None, "--stacked": stacked,
                                "--ranks": ranks is not None, "--targets": targets != "q,k,v,o",
                                "--weighted/--unweighted": weighted is not None})
        common.pop("targets"), common.pop("ratio")
        parsed = parse_top_k(top_k) if top_k is not None else None
        request = CompressLoki(**common, rank=rank, variance=variance, top_k=parsed, basis=basis, stream=stream)
        execute(Recipe.from_request(request), dry_run, overwrite, print_recipe, json_output, device)
        return
    if top_k is not None or basis != "post-rope" or variance is not None:
        raise UserError(f"--top-k, --basis and --variance are for --method loki, not {method}")
    if method in TENSOR_METHODS:
        reject_options(method, {"--kv-latent": kv_latent, "--allocate": allocate, "--stacked": stacked and method != "tucker"})
        if method == "tucker" and rank is not None:
            modes = "head_dim,hidden (e.g. --ranks 64,200)" if stacked else "heads,head_dim,hidden (e.g. --ranks 9,48,160)"
            raise UserError(f"tucker takes one rank per mode: --ranks {modes}")
        if method == "cp" and ranks is not None:
            raise UserError("cp takes a single rank: --rank R")
        mode_ranks = parse_ranks(ranks) if ranks is not None else (rank,) if rank is not None else None
        request = CompressHeadTensor(**common, ranks=mode_ranks, weighted=True if weighted is None else weighted,
                                     stacked=stacked, stream=stream)
    else:
        reject_options(method, {"--stacked": stacked})
        if ranks is not None:
            raise UserError(f"--ranks is for tucker; {method} takes one rank: --rank R")
        request = CompressLowRank(**common, rank=rank, kv_latent=kv_latent, allocate=allocate, weighted=weighted,
                                  stream=stream)
    execute(Recipe.from_request(request), dry_run, overwrite, print_recipe, json_output, device)



def reject_options(method: str, given: dict[str, bool]) -> None:
    used = [flag for flag, on in given.items() if on]
    if used:
        raise UserError(f"{', '.join(used)} {'does' if len(used) == 1 else 'do'} not apply to --method {method}")


def parse_ranks(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--ranks expects comma-separated integers such as 9,48,160, got '{text}'") from None
