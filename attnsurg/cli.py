"""The ``attnsurg`` command line: thin commands that build a typed request and call the library."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

import attnsurg
from attnsurg import ui
from attnsurg.errors import UserError

app = typer.Typer(
    help="Attention surgery for pretrained causal language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
eval_app = typer.Typer(help="Measure models: perplexity and cost, side by side.", no_args_is_help=True)
assets_app = typer.Typer(help="Built-in demo model and sample texts, fetched at run time.")
app.add_typer(eval_app, name="eval")
app.add_typer(assets_app, name="assets")

# Tables go to stdout; piped output keeps full rows instead of rich's 80-column default.
out = Console() if sys.stdout.isatty() else Console(width=160)


def user_errors(command):
    """Turn a UserError (or an invalid request) into one red line and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except UserError as exc:
            ui.console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(UserError.exit_code)
        except ValidationError as exc:
            ui.console.print(f"[bold red]error:[/] {validation_message(exc)}", highlight=False, soft_wrap=True)
            raise typer.Exit(UserError.exit_code)

    return wrapper


def validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def version_callback(value: bool) -> None:
    if value:
        out.print(f"attnsurg {attnsurg.__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=version_callback, is_eager=True, help="Print the version and exit.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or status messages.")] = False,
) -> None:
    ui.set_quiet(quiet)
    quiet_libraries()


def quiet_libraries() -> None:
    """attnsurg shows its own progress; the libraries' tqdm bars and info logs would only add noise."""
    import logging

    import huggingface_hub.utils
    import transformers

    logging.getLogger("accelerate").setLevel(logging.ERROR)  # e.g. tied weights noted at every saved heal state
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    huggingface_hub.utils.logging.set_verbosity_error()  # retries against an unreachable hub end in one error line


TrustRemoteCode = Annotated[
    bool, typer.Option("--trust-remote-code", help="Allow running modeling code shipped with the checkpoint.")
]
AllowPickle = Annotated[bool, typer.Option("--allow-pickle", help="Allow loading pickle (.bin) weights.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON record instead of a table.")]
# Options every surgery command (convert, compress) shares.
CalibDataset = Annotated[str, typer.Option("--calib-dataset", help="Built-in dataset; its calibration part is used.")]
CalibText = Annotated[Optional[Path], typer.Option("--calib-text", help="A UTF-8 file to calibrate on instead.")]
CalibTokens = Annotated[int, typer.Option("--calib-tokens", help="Calibration tokens.")]
CalibSeqLen = Annotated[
    int, typer.Option("--calib-seq-len", help="Tokens per calibration window (calibrate at the context you will use).")
]
EvalTokens = Annotated[int, typer.Option("--eval-tokens", help="Tokens of the eval part scored before/after (0: skip).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")]
Seed = Annotated[int, typer.Option("--seed")]
PrintRecipe = Annotated[
    bool, typer.Option("--print-recipe", help="Print the YAML recipe this command corresponds to (with --dry-run: and stop).")
]


def calibration_from(dataset: str, text: Path | None, tokens: int, seq_len: int):
    """The Calibration request the --calib-* options describe (always the calibration part)."""
    from attnsurg.recipe import Calibration, TextData

    data = TextData(text=text, part="calib") if text else TextData(dataset=dataset, part="calib")
    return Calibration(data=data, tokens=tokens, seq_len=seq_len)


# ---------------------------------------------------------------------------------------------- info
@app.command()
@user_errors
def info(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, .gguf file, hub id or built-in name.")],
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Print a model's attention anatomy and which attnsurg methods support it."""
    from attnsurg.info import describe
    from attnsurg.recipe import InfoRequest, ModelRef

    request = InfoRequest(model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle))
    record = describe(request)
    if json_output:
        print(json.dumps(record, indent=2))
    else:
        out.print(info_table(record))


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def info_table(record: dict) -> Table:
    a = record["anatomy"]
    table = Table(title=f"{record['model']}: attention anatomy", show_header=False, title_justify="left")
    table.add_column("property", style="bold")
    table.add_column("value")
    rows = [
        ("family (model_type)", f"{a['model_type']}" + ("" if a["family"] else "  [yellow](no surgery support)[/]")),
        ("attention", a["attention_kind"].upper()),
        ("layers", str(a["num_layers"])),
        ("hidden size", str(a["hidden_size"])),
        ("query heads", str(a["num_heads"])),
        ("KV heads", str(a["num_kv_heads"])),
        ("head dim", str(a["head_dim"])),
    ]
    if a["mla"]:
        rows += [(k.replace("_", " "), str(v)) for k, v in a["mla"].items()]
    rope = f"{a['rope_type']}, theta {a['rope_theta']:g}" if a["rope_theta"] is not None else "none"
    biases = ", ".join(n for n in "qkvo" if a[f"{n}_bias"]) or "none"
    window = f"{a['sliding_window']} tokens on {a['sliding_layers']} layers" if a["sliding_window"] else "none"
    attn_share = a["attention_parameters"] / a["total_parameters"]
    rows += [
        ("RoPE", rope),
        ("biases", biases),
        ("q/k norms", _yes_no(a["qk_norm"])),
        ("sliding window", window),
        ("max positions", str(a["max_positions"])),
        ("tied embeddings", _yes_no(a["tied_embeddings"])),
        ("parameters (attention / total)", f"{a['attention_parameters']:,} / {a['total_parameters']:,} ({attn_share:.1%})"),
        ("KV values per token", f"{a['kv_values_per_token']:,} ("
         + ("mean " if len(set(a["kv_layer_values"])) > 1 else "") + f"{a['kv_values_per_layer']} per layer)"),
        (f"KV bytes per token ({a['dtype']})", f"{a['kv_bytes_per_token']:,}"),
        ("KV bytes per token (bfloat16)", f"{a['kv_bytes_per_token_bf16']:,}"),
        ("methods", methods_cell(record["methods"])),
    ]
    if a["surgery"]:
        rows.insert(-1, ("surgery", surgery_cell(a["surgery"])))
    for name, value in rows:
        table.add_row(name, value)
    return table


def headline_rank(value) -> int:
    """One number per record entry: a rank, the sum of cached k/v ranks, or a tensor's hidden rank."""
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        return sum(value)
    return value["rank"] if "rank" in value else value["ranks"][-1]


def surgery_cell(surgery: dict) -> str:
    """What attnsurg did to a checkpoint it wrote: method and the spread of ranks."""
    lines = [f"{surgery.get('method', '?')}" + (", consumer-weighted" if surgery.get("weighted") else "")]
    for key, label in (("low_rank", "low-rank projections"), ("kv_latent", "k/v latent layers"),
                       ("head_tensor", "tensor-decomposed projections"), ("factored_kv", "layers caching k/v factors"),
                       ("stacked_tucker", "stacked Tucker layers")):
        ranks = [headline_rank(value) for value in (surgery.get(key) or {}).values()]
        if ranks:
            spread = str(ranks[0]) if min(ranks) == max(ranks) else f"{min(ranks)}-{max(ranks)}"
            lines.append(f"{len(ranks)} {label}, rank {spread}")
    return "\n".join(lines)


def methods_cell(methods: dict[str, str | None]) -> str:
    if not methods:
        return "none installed"
    return "\n".join(f"{n}: " + ("[green]yes[/]" if why is None else f"[yellow]no[/] ({why})") for n, why in methods.items())


# ------------------------------------------------------------------------------------ eval perplexity
@eval_app.command("perplexity")
@user_errors
def eval_perplexity(
    models: Annotated[list[str], typer.Argument(help="One or more models; the first is the reference for ratios.")],
    text: Annotated[Optional[Path], typer.Option("--text", help="A UTF-8 text file to evaluate on (used whole).")] = None,
    dataset: Annotated[
        Optional[str], typer.Option("--dataset", help="Built-in text: wiki-sample (default), c4-sample, wikitext2.")
    ] = None,
    max_length: Annotated[int, typer.Option("--max-length", help="Window length in tokens.")] = 1024,
    stride: Annotated[
        Optional[int], typer.Option("--stride", help="Window step; default = max-length (disjoint windows).")
    ] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Use only the first N tokens.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Windows per forward pass.")] = 1,
    dtype: Annotated[str, typer.Option("--dtype", help="auto (float32 on CPU), float32, bfloat16, float16.")] = "auto",
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N.")] = "auto",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Perplexity (token, word, bits per byte) and cost of one or more models on the same windows."""
    from attnsurg.eval.perplexity import run_perplexity
    from attnsurg.recipe import ModelRef, PerplexityEval, TextData

    request = PerplexityEval(
        models=[ModelRef(ref=m, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle) for m in models],
        data=TextData(dataset=dataset, text=text, part="eval") if text else TextData(dataset=dataset or "wiki-sample"),
        max_length=max_length,
        stride=stride,
        max_tokens=max_tokens,
        batch_size=batch_size,
        dtype=dtype,
        device=device,
        seed=seed,
    )
    report = run_perplexity(request)
    if json_output:
        print(json.dumps(report.to_dict(), indent=2))
        return
    out.print(perplexity_table(report))
    for r in report.results:
        if r.surgery:
            recall = f"; top-k recall {r.top_k_recall:.3f} on the first window" if r.top_k_recall is not None else ""
            out.print(f"{r.model}: {r.surgery}{recall}", highlight=False)
    for note in report.notes:
        out.print(f"[yellow]note:[/] {note}")


def _optional(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def perplexity_table(report) -> Table:
    where = f"{report.text} ({report.part})"
    stride = "disjoint" if report.stride == report.max_length else f"stride {report.stride}"
    title = f"Perplexity on {where}, windows of {report.max_length} tokens, {stride}"
    table = Table(title=title, title_justify="left")
    for column in ("model", "ppl", "ratio", "word ppl", "bits/byte", "tokens", "KV B/token", "params (attn)", "tok/s"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in report.results:
        table.add_row(
            f"{r.model}\n[dim]{r.model_type}, {r.dtype}, {r.device}[/]",
            f"{r.ppl:.4f}",
            f"{r.ratio:.4f}",
            _optional(r.word_ppl, ".3f"),
            _optional(r.bits_per_byte, ".4f"),
            f"{r.tokens_scored:,}",
            f"{r.kv_bytes_per_token:,}",
            f"{r.parameters / 1e6:.1f}M ({r.attention_parameters / 1e6:.1f}M)",
            f"{r.tokens_per_second:,.0f}",
        )
    return table


# ------------------------------------------------------------------------------------------ convert
@app.command()
@user_errors
def convert(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, .gguf file, hub id or built-in name.")],
    to: Annotated[str, typer.Option("--to", help="Target attention: mla.")] = "mla",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory.")] = None,
    kv_budget: Annotated[
        Optional[float], typer.Option("--kv-budget", help="Fraction of the original KV cache per token (default 0.5).")
    ] = None,
    kv_rank: Annotated[Optional[int], typer.Option("--kv-rank", help="Latent rank (instead of --kv-budget).")] = None,
    rope_dim: Annotated[Optional[int], typer.Option("--rope-dim", help="Dims of the shared RoPE key (even, <= head dim).")] = None,
    rope_layout: Annotated[
        str,
        typer.Option("--rope-layout", help="standard (every engine) or flexible (any frequency, repeats; transformers only)."),
    ] = "standard",
    calib_dataset: CalibDataset = "wiki-sample",
    calib_text: CalibText = None,
    calib_tokens: CalibTokens = 4096,
    calib_seq_len: CalibSeqLen = 512,
    unweighted: Annotated[bool, typer.Option("--unweighted", help="Plain PCA for the latent (no consumer weighting).")] = False,
    refine_steps: Annotated[
        int, typer.Option("--refine-steps", help="Adam steps per layer (128 query positions of one calibration window each) against the original layer's output (0: closed form only).")
    ] = 40,
    refine_tokens: Annotated[
        Optional[int], typer.Option("--refine-tokens", help="Calibration tokens used for refinement [default: the first 2048].")
    ] = None,
    refine_lr: Annotated[float, typer.Option("--refine-lr", help="Refinement learning rate (the peak, with cosine).")] = 1e-3,
    refine_schedule: Annotated[
        str, typer.Option("--refine-schedule", help="constant, or cosine (decays to a tenth; pays on long refinements).")
    ] = "constant",
    eval_tokens: EvalTokens = 2048,
    dry_run: DryRun = False,
    print_recipe: PrintRecipe = False,
    overwrite: Overwrite = False,
    seed: Seed = 0,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Convert attention to another form and write a new checkpoint (GQA/MHA -> MLA)."""
    from attnsurg.recipe import ConvertMLA, ModelRef, Recipe

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
        weighted=not unweighted,
        refine_steps=refine_steps,
        refine_tokens=refine_tokens,
        refine_lr=refine_lr,
        refine_schedule=refine_schedule,
        calibration=calibration_from(calib_dataset, calib_text, calib_tokens, calib_seq_len),
        eval_tokens=eval_tokens,
        overwrite=overwrite,
        seed=seed,
    )
    execute(Recipe.from_request(request), dry_run, overwrite, print_recipe, json_output)


def print_convert_report(model: str, report, json_output: bool) -> None:
    from attnsurg.convert import plan_rows

    rows = plan_rows(report.plan, report.anatomy)
    if json_output:
        record = {"plan": rows, "written": report.written, "seconds": report.seconds, "convert_seconds": report.convert_seconds,
                  "peak_memory_gb": report.peak_memory_gb, "ppl_before": report.ppl_before, "ppl_after": report.ppl_after,
                  "layer_errors": report.layer_errors, "heal": heal_record(report.heal)}
        print(json.dumps(record, indent=2))
        return
    title = f"MLA plan for {model}, {report.plan.layout} RoPE layout (identical in every layer)"
    table = Table(title=title, title_justify="left")
    for column in ("layers", "latent rank", "RoPE dims", "qk nope dim", "KV values/token", "attention params/layer"):
        table.add_column(column, justify="right")
    r = rows[0]
    table.add_row(
        f"0-{len(rows) - 1}", f"{r['latent_rank']} + 1 norm", str(r["rope_dims"]), str(r["qk_nope_dim"]),
        f"{r['kv_values_before']} -> {r['kv_values_after']}", f"{r['attention_params_before']:,} -> {r['attention_params_after']:,}",
    )
    out.print(table)
    if report.written:
        out.print(f"wrote {report.written} in {report.seconds:.1f} s (conversion {report.convert_seconds:.1f} s, "
                  f"calibration included), peak memory {report.peak_memory_gb:.2f} GB")
    if report.mean_layer_error:
        before, after = report.mean_layer_error
        out.print(f"mean relative layer error against the original residual stream: {before:.4f} -> {after:.4f} (refinement)")
    print_heal_summary(report.heal)
    print_ppl(report)


def print_ppl(report) -> None:
    if report.ppl_before is None:
        return
    start = getattr(getattr(report, "heal", None), "ppl_start", None)
    surgery = f"{start:.3f} (x{start / report.ppl_before:.3f}) after the surgery, " if start is not None else ""
    healed = " after healing" if surgery else ""
    out.print(f"ppl {report.ppl_before:.3f} -> {surgery}{report.ppl_after:.3f}{healed} (x{report.ppl_after / report.ppl_before:.3f})")


def heal_record(heal) -> dict | None:
    if heal is None:
        return None
    return {"steps": heal.steps, "tokens": heal.tokens, "resumed_from": heal.resumed_from, "seconds": heal.seconds,
            "tokens_per_second": heal.tokens_per_second, "trainable_parameters": heal.trainable_parameters,
            "losses": heal.losses, "evals": heal.evals, "ppl_start": heal.ppl_start}


def print_heal_summary(heal) -> None:
    if heal is None:
        return
    first, last = heal.losses[0][1] if heal.losses else float("nan"), heal.losses[-1][1] if heal.losses else float("nan")
    resumed = f", resumed from step {heal.resumed_from}" if heal.resumed_from else ""
    out.print(f"healed {heal.steps} steps ({heal.tokens:,} tokens{resumed}) in {heal.seconds:.1f} s, "
              f"{heal.tokens_per_second:,.0f} tokens/s, {heal.trainable_parameters:,} trainable parameters; "
              f"distillation loss {first:.4f} -> {last:.4f}")


# ------------------------------------------------------------------------------------------ compress
LOW_RANK_METHODS = ("svd", "asvd", "svdllm")
TENSOR_METHODS = ("tucker", "cp")
SPARSE_METHODS = ("loki",)


@app.command()
@user_errors
def compress(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, .gguf file, hub id or built-in name.")],
    method: Annotated[
        str, typer.Option("--method", "-m", help="svd, asvd, svdllm (low rank), tucker, cp (tensor) or loki (top-k).")
    ] = "svdllm",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory.")] = None,
    targets: Annotated[str, typer.Option("--targets", help="Projections to factorize, comma-separated from q,k,v,o.")] = "q,k,v,o",
    ratio: Annotated[
        Optional[float],
        typer.Option("--ratio", help="Fraction of the targeted projections' parameters kept, in (0, 1]; "
                     "with --kv-latent, the fraction of the KV cache kept."),
    ] = None,
    rank: Annotated[
        Optional[int], typer.Option("--rank", help="One rank for every targeted projection (low rank, cp; instead of --ratio).")
    ] = None,
    ranks: Annotated[
        Optional[str], typer.Option("--ranks", help="Tucker mode ranks heads,head_dim,hidden; with --stacked head_dim,hidden (instead of --ratio).")
    ] = None,
    top_k: Annotated[
        Optional[str], typer.Option("--top-k", help="Loki: keys kept per query, a count (64) or a fraction of the context (0.25, 1/4).")
    ] = None,
    basis: Annotated[str, typer.Option("--basis", help="Loki: PCA of post-rope (default) or pre-rope keys.")] = "post-rope",
    variance: Annotated[
        Optional[float],
        typer.Option("--variance", help="Loki: per-layer ranks keeping this share of the key variance (instead of --rank)."),
    ] = None,
    kv_latent: Annotated[
        bool, typer.Option("--kv-latent", help="k and v share one cached latent per layer (a real KV-cache saving; --targets k,v).")
    ] = False,
    allocate: Annotated[
        bool, typer.Option("--allocate", help="Spread the budget over layers and projections by truncation energy, not uniformly.")
    ] = False,
    weighted: Annotated[
        Optional[bool],
        typer.Option("--weighted/--unweighted", help="Weight by what consumes each output (queries, keys, W_o). Default: on for svdllm, tucker, cp."),
    ] = None,
    stacked: Annotated[
        bool, typer.Option("--stacked", help="Tucker: q, k, v, o of a layer in one decomposition, factors shared "
                           "across heads and projections (TensorLLM); --ranks head_dim,hidden.")
    ] = False,
    calib_dataset: CalibDataset = "wiki-sample",
    calib_text: CalibText = None,
    calib_tokens: CalibTokens = 4096,
    calib_seq_len: CalibSeqLen = 512,
    eval_tokens: EvalTokens = 2048,
    dry_run: DryRun = False,
    print_recipe: PrintRecipe = False,
    overwrite: Overwrite = False,
    seed: Seed = 0,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Compress attention projections (low rank or tensor-decomposed) and write a new checkpoint."""
    from attnsurg.methods.lowrank import parse_targets
    from attnsurg.recipe import CompressHeadTensor, CompressLoki, CompressLowRank, ModelRef, Recipe

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
        request = CompressLoki(**common, rank=rank, variance=variance, top_k=parsed, basis=basis)
        execute(Recipe.from_request(request), dry_run, overwrite, print_recipe, json_output)
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
                                     stacked=stacked)
    else:
        reject_options(method, {"--stacked": stacked})
        if ranks is not None:
            raise UserError(f"--ranks is for tucker; {method} takes one rank: --rank R")
        request = CompressLowRank(**common, rank=rank, kv_latent=kv_latent, allocate=allocate, weighted=weighted)
    execute(Recipe.from_request(request), dry_run, overwrite, print_recipe, json_output)


def print_compress_report(model: str, report, dry_run: bool, json_output: bool) -> None:
    from attnsurg.compress import projection_flops, rank_rows

    plan = report.plan
    rows = rank_rows(plan)
    flops = projection_flops(plan)
    if json_output:
        record = {"plan": rank_rows(plan, labels=False), "kept_fraction": plan.kept_fraction, "params": [plan.params_before(), plan.params_after()],
                  "projection_flops_per_token": list(flops), "kv_values_per_token": [report.anatomy.kv_values_per_token, plan.kv_values_after()],
                  "written": report.written, "seconds": report.seconds, "factorize_seconds": report.factorize_seconds,
                  "peak_memory_gb": report.peak_memory_gb, "ppl_before": report.ppl_before, "ppl_after": report.ppl_after,
                  "heal": heal_record(report.heal)}
        print(json.dumps(record, indent=2))
        return
    out.print(lowrank_plan_table(model, plan, rows, dry_run))
    budget = "KV cache" if plan.kv_latent else "targeted parameters"
    out.print(
        f"kept {plan.kept_fraction:.3f} of the {budget}; projection params {plan.params_before():,} -> {plan.params_after():,}, "
        f"FLOPs/token {flops[0]:,} -> {flops[1]:,}; KV values/token {report.anatomy.kv_values_per_token:,} -> {plan.kv_values_after():,}"
    )
    if report.written:
        out.print(f"wrote {report.written} in {report.seconds:.1f} s (factorization {report.factorize_seconds:.1f} s), "
                  f"peak memory {report.peak_memory_gb:.2f} GB")
    print_heal_summary(report.heal)
    print_ppl(report)


def print_loki_report(model: str, report, json_output: bool) -> None:
    plan = report.plan
    record = {"rank": plan.rank, "ranks": plan.layer_ranks(), "variance": plan.variance, "top_k": plan.top_k,
              "basis": plan.basis, "written": report.written,
              "seconds": report.seconds, "ppl_before": report.ppl_before, "ppl_after": report.ppl_after,
              "heal": heal_record(report.heal)}
    if json_output:
        print(json.dumps(record, indent=2))
        return
    top_k = f"{plan.top_k:g} of the context" if isinstance(plan.top_k, float) else f"{plan.top_k} keys"
    if plan.rank is not None:
        scoring = f"{plan.rank} of {plan.head_dim} principal coordinates"
    else:
        ranks = f"; ranks {plan.rank_label()}" if plan.ranks else " (set after calibration)"
        scoring = (f"its own rank, the fewest of {plan.head_dim} principal coordinates holding {plan.variance:g} of "
                   f"the key variance{ranks}")
    out.print(f"loki plan for {model}: every layer scores keys with {scoring} ({plan.basis} basis) and attends "
              f"over the top {top_k}")
    if report.written:
        out.print(f"wrote {report.written} in {report.seconds:.1f} s, peak memory {report.peak_memory_gb:.2f} GB")
    print_heal_summary(report.heal)
    print_ppl(report)


def reject_options(method: str, given: dict[str, bool]) -> None:
    used = [flag for flag, on in given.items() if on]
    if used:
        raise UserError(f"{', '.join(used)} {'does' if len(used) == 1 else 'do'} not apply to --method {method}")


def parse_ranks(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--ranks expects comma-separated integers such as 9,48,160, got '{text}'") from None


def lowrank_plan_table(model: str, plan, rows: list[dict], dry_run: bool) -> Table:
    """Ranks per layer; consecutive layers with the same ranks share one row."""
    from attnsurg.compress import COLUMN_TITLES, plan_columns

    names = plan_columns(plan)
    note = ""
    if dry_run and plan.allocate:
        note = " (uniform; --allocate redistributes after calibration)"
    if dry_run and getattr(plan, "choose_ranks", False):
        note = " (Tucker heads x head_dim x hidden; the split between modes is chosen per projection after calibration)"
    table = Table(title=f"{plan.method} plan for {model}{note}", title_justify="left")
    table.add_column("layers", justify="right")
    for name in names:
        table.add_column(COLUMN_TITLES[name], justify="right")
    table.add_column("params/layer", justify="right")
    groups: list[list[dict]] = []
    for row in rows:
        key = [row[n] for n in names]
        if groups and [groups[-1][0][n] for n in names] == key:
            groups[-1].append(row)
        else:
            groups.append([row])
    for group in groups:
        first, last = group[0], group[-1]
        span = str(first["layer"]) if first is last else f"{first['layer']}-{last['layer']}"
        cells = [first[n] for n in names]
        table.add_row(span, *cells, f"{first['params_before']:,} -> {first['params_after']:,}")
    return table


# ------------------------------------------------------------------------------------ recipes, run
def execute(recipe, dry_run: bool, overwrite: bool, print_recipe: bool, json_output: bool) -> None:
    """Run a recipe (what every surgery command does) and print its report."""
    from attnsurg.io.recipe_file import dump_recipe
    from attnsurg.pipeline import is_main_process
    from attnsurg.run import run_recipe

    if print_recipe and json_output:
        raise UserError("--print-recipe and --json both write to stdout; pass one of them")
    if print_recipe:
        print(dump_recipe(recipe), end="")
        if dry_run:
            return
    report = run_recipe(recipe, dry_run=dry_run, overwrite=overwrite)
    if is_main_process():  # under `accelerate launch` the main process reports
        print_report(recipe, report, dry_run, json_output)


def print_report(recipe, report, dry_run: bool, json_output: bool) -> None:
    from attnsurg.convert import ConvertReport
    from attnsurg.methods.loki import LokiPlan
    from attnsurg.run import HealRunReport

    model = recipe.model.ref
    if isinstance(report, ConvertReport):
        print_convert_report(model, report, json_output)
    elif isinstance(report, HealRunReport):
        print_heal_report(recipe, report, dry_run, json_output)
    elif isinstance(report.plan, LokiPlan):
        print_loki_report(model, report, json_output)
    else:
        print_compress_report(model, report, dry_run, json_output)


@app.command()
@user_errors
def run(
    recipe_path: Annotated[Path, typer.Argument(metavar="RECIPE", help="A recipe file, or a shipped recipe's name (see `attnsurg recipe list`).")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write here instead of the recipe's output.")] = None,
    dry_run: DryRun = False,
    overwrite: Overwrite = False,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Run a YAML recipe: surgery, optional healing, evaluation, checkpoint."""
    from attnsurg.io.recipe_file import load_recipe
    from attnsurg.run import check_permissions

    recipe = load_recipe(recipe_path)
    if output is not None:
        recipe = recipe.model_copy(update={"output": output})
    check_permissions(recipe, trust_remote_code, allow_pickle)
    execute(recipe, dry_run, overwrite, print_recipe=False, json_output=json_output)


recipe_app = typer.Typer(help="Check recipes and list the ones that ship with attnsurg.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("validate")
@user_errors
def recipe_validate(
    paths: Annotated[list[Path], typer.Argument(metavar="RECIPE...", help="Recipe files or shipped names.")],
) -> None:
    """Check recipes against the schema (unknown keys, types, methods) without running them."""
    from attnsurg.io.recipe_file import load_recipe, resolve_recipe

    for path in paths:
        recipe = load_recipe(path)
        kinds = " -> ".join(recipe_step_label(step) for step in recipe.steps)
        out.print(f"{resolve_recipe(path)}: ok ({recipe.model.ref}: {kinds} -> {recipe.output})", highlight=False)


def recipe_step_label(step) -> str:
    from attnsurg.recipe import step_kind

    kind = step_kind(step)
    settings = getattr(step, kind)
    if kind == "convert":
        budget = f"kv_budget {settings.kv_budget}" if settings.kv_budget is not None else f"kv_rank {settings.kv_rank}"
        return f"convert to mla ({budget})"
    if kind == "compress":
        budget = {name: getattr(settings, name, None) for name in ("ratio", "rank", "ranks", "top_k")}
        shown = ", ".join(f"{name} {value}" for name, value in budget.items() if value is not None)
        latent = ", k/v latent" if getattr(settings, "kv_latent", False) else ""
        latent += ", stacked q,k,v,o" if getattr(settings, "stacked", False) else ""
        return f"compress {settings.method} ({shown or 'default budget'}{latent})"
    return f"heal ({settings.tokens:,} tokens)"


@recipe_app.command("list")
@user_errors
def recipe_list(json_output: JsonFlag = False) -> None:
    """The recipes that ship in recipes/: name, what they do, and their steps."""
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


# ---------------------------------------------------------------------------------------------- heal
@app.command()
@user_errors
def heal(
    model: Annotated[str, typer.Argument(help="The operated checkpoint (the student).")],
    teacher: Annotated[str, typer.Option("--teacher", help="The original model the student was made from.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory.")] = None,
    dataset: Annotated[str, typer.Option("--dataset", help="Built-in dataset; its calibration part is used.")] = "wiki-sample",
    text: Annotated[Optional[Path], typer.Option("--text", help="A UTF-8 file to train on instead (used whole).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Training tokens (the budget).")] = 100_000,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per training window.")] = 1024,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Windows per micro-batch (per process).")] = 1,
    grad_accum: Annotated[int, typer.Option("--grad-accum", help="Micro-batches per optimizer step.")] = 1,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW).")] = 1.5e-4,
    schedule: Annotated[str, typer.Option("--schedule", help="cosine, linear or constant (after warmup).")] = "cosine",
    warmup: Annotated[float, typer.Option("--warmup", help="Fraction of the steps spent warming up.")] = 0.05,
    kl_weight: Annotated[float, typer.Option("--kl-weight", help="Weight of KL(teacher || student).")] = 1.0,
    lm_weight: Annotated[float, typer.Option("--lm-weight", help="Weight of the next-token loss.")] = 0.0,
    hidden_weight: Annotated[
        float, typer.Option("--hidden-weight", help="Weight of the residual-stream match after every layer (0: off).")
    ] = 0.0,
    temperature: Annotated[float, typer.Option("--temperature", help="Distillation temperature.")] = 1.0,
    train: Annotated[str, typer.Option("--train", help="attention (the new or changed attention parameters) or all.")] = "attention",
    eval_every: Annotated[
        int, typer.Option("--eval-every", help="Held-out ppl (on --eval-tokens) every N steps (0: only at the end).")
    ] = 0,
    save_every: Annotated[int, typer.Option("--save-every", help="Save resumable state every N steps.")] = 25,
    mixed_precision: Annotated[str, typer.Option("--mixed-precision", help="auto (bf16 on a GPU), no, bf16, fp16.")] = "auto",
    eval_tokens: Annotated[
        int, typer.Option("--eval-tokens", help="Tokens of the dataset's eval part (a --text file: its start) scored before/after (0: skip).")
    ] = 2048,
    dry_run: DryRun = False,
    print_recipe: PrintRecipe = False,
    overwrite: Overwrite = False,
    seed: Seed = 0,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Heal an operated model by distillation from the original (KL to its logits), with accelerate.

    Interrupted runs resume from OUTPUT.heal-state when started again with the same settings."""
    from attnsurg.recipe import Calibration, Evaluation, HealSettings, HealStep, ModelRef, Recipe, TextData

    if output is None and not dry_run:
        raise UserError("missing --output/-o: the directory to write the healed checkpoint to")
    data = TextData(text=text, part="calib") if text else TextData(dataset=dataset, part="calib")
    settings = HealSettings(
        teacher=ModelRef(ref=teacher, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle),
        data=data, tokens=tokens, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
        schedule=schedule, warmup=warmup, kl_weight=kl_weight, lm_weight=lm_weight, hidden_weight=hidden_weight, temperature=temperature,
        train=train, eval_every=eval_every, save_every=save_every, mixed_precision=mixed_precision,
        eval_tokens=eval_tokens if eval_tokens > 1 else HealSettings.model_fields["eval_tokens"].default,
    )
    recipe = Recipe(
        model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle),
        output=output or Path("OUT"),  # a dry run writes nothing
        steps=[HealStep(heal=settings)],
        calibration=Calibration(data=data),  # scoring reads its eval part
        eval=Evaluation(tokens=eval_tokens),
        seed=seed,
    )
    execute(recipe, dry_run, overwrite, print_recipe, json_output)


def print_heal_report(recipe, report, dry_run: bool, json_output: bool) -> None:
    settings = recipe.heal
    if json_output:
        record = {"written": report.written, "seconds": report.seconds, "peak_memory_gb": report.peak_memory_gb,
                  "ppl_teacher": report.ppl_teacher, "ppl_before": report.ppl_before, "ppl_after": report.ppl_after,
                  "heal": heal_record(report.heal)}
        print(json.dumps(record, indent=2))
        return
    if dry_run:
        out.print(f"heal plan: {recipe.model.ref} distilled from {settings.teacher.ref} on {settings.tokens:,} tokens "
                  f"(windows of {settings.seq_len}, batch {settings.batch_size} x {settings.grad_accum} accumulation, "
                  f"lr {settings.lr} {settings.schedule}), training {settings.train}; writes {recipe.output}")
        return
    out.print(f"wrote {report.written} in {report.seconds:.1f} s, peak memory {report.peak_memory_gb:.2f} GB")
    print_heal_summary(report.heal)
    if report.ppl_before is not None:
        out.print(f"ppl teacher {report.ppl_teacher:.3f}; student {report.ppl_before:.3f} -> {report.ppl_after:.3f} "
                  f"(x{report.ppl_before / report.ppl_teacher:.3f} -> x{report.ppl_after / report.ppl_teacher:.3f} of the teacher)")


# -------------------------------------------------------------------------------------------- assets
@assets_app.callback(invoke_without_command=True)
def assets_default(ctx: typer.Context) -> None:
    """List the built-in assets and whether they are cached (same as `assets list`)."""
    if ctx.invoked_subcommand is None:
        assets_list()


@assets_app.command("list")
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


@assets_app.command("fetch")
@user_errors
def assets_fetch(
    names: Annotated[Optional[list[str]], typer.Argument(help="Assets to fetch; default all.")] = None,
) -> None:
    """Fetch built-in assets into the cache (verified by SHA-256)."""
    from attnsurg.io.assets import ASSETS, ensure_demo_model, ensure_text

    for name in names or list(ASSETS):
        if name not in ASSETS:
            raise UserError(f"unknown asset '{name}'; choose from {', '.join(ASSETS)}")
        path = ensure_demo_model(name) if ASSETS[name].kind == "model" else ensure_text(name)
        out.print(f"{name}: {path}")


def main() -> None:
    app(prog_name="attnsurg")


if __name__ == "__main__":
    sys.exit(main())
