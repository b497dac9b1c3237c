"""`attnsurg eval ...`: measure models side by side."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from attnsurg.cli.common import (
    EVALUATION,
    OUTPUT,
    AllowPickle,
    EvalDevice,
    EvalDType,
    JsonFlag,
    TrustRemoteCode,
    eval_app,
    examples,
    out,
    user_errors,
)
from attnsurg import ui
from attnsurg.errors import UserError


@eval_app.command("perplexity", epilog=examples(
    "attnsurg eval perplexity smollm2-135m out/mla50",
    "attnsurg eval perplexity smollm2-135m out/mla50 --dataset all --tokens 2048",
    "attnsurg eval perplexity smollm2-135m --seq-len 512 --stride 256",
    guide="eval.md"))
@user_errors
def eval_perplexity(
    models: Annotated[list[str], typer.Argument(help="Models to score, the first as the reference.")],
    text: Annotated[Optional[Path], typer.Option("--text", help="A UTF-8 file to score instead (used whole).",
                                                 rich_help_panel=EVALUATION)] = None,
    dataset: Annotated[
        Optional[str],
        typer.Option("--dataset", help="Built-in texts or all (default: wiki-sample).", rich_help_panel=EVALUATION),
    ] = None,
    max_length: Annotated[int, typer.Option("--seq-len", "--max-length", help="Window length in tokens.",
                                            rich_help_panel=EVALUATION)] = 1024,
    stride: Annotated[
        Optional[int], typer.Option("--stride", help="Window step (default: the window length).",
                                    rich_help_panel=EVALUATION)
    ] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--tokens", "--max-tokens", help="Score only the first N tokens of each text.",
                                                      rich_help_panel=EVALUATION)] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Windows per forward pass.",
                                            rich_help_panel=EVALUATION)] = 1,
    by_position: Annotated[bool, typer.Option("--by-position", help="Also the ppl per band of positions (0-512, 512-1K...).",
                                              rich_help_panel=EVALUATION)] = False,
    dtype: EvalDType = "auto",
    device: EvalDevice = "auto",
    seed: Annotated[int, typer.Option("--seed", help="Random seed set before scoring.", rich_help_panel=OUTPUT)] = 0,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Perplexity and cost of one or more models on the same windows."""
    from attnsurg.data import parse_datasets
    from attnsurg.eval.perplexity import run_perplexity
    from attnsurg.requests import ModelRef, PerplexityEval, TextData

    if text and dataset:
        raise UserError("pass either --dataset or --text, not both")
    texts = [TextData(text=text, part="eval")] if text else [TextData(dataset=d) for d in parse_datasets(dataset or "wiki-sample")]
    request = PerplexityEval(
        models=[ModelRef(ref=m, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle) for m in models],
        data=texts[0],
        more_data=texts[1:],
        max_length=max_length,
        stride=stride,
        max_tokens=max_tokens,
        batch_size=batch_size,
        by_position=by_position,
        dtype=dtype,
        device=device,
        seed=seed,
    )
    report = run_perplexity(request)
    if json_output:
        print(json.dumps(report.to_dict(), indent=2))
        return
    out.print(perplexity_table(report) if len(report.texts) == 1 else domain_table(report))
    if by_position:
        for text in report.texts:
            out.print(position_table(report, text))
    for r in report.results:
        if r.surgery and r.text == report.texts[0]:
            recall = f"; top-k recall {r.top_k_recall:.3f} on the first window" if r.top_k_recall is not None else ""
            out.print(f"{r.model}: {r.surgery}{recall}", highlight=False)
    for note in report.notes:
        out.print(Text.assemble(("note:", "yellow"), f" {note}"))


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
            ui.described(r.model, f"{r.model_type}, {r.dtype}, {r.device}"),
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


def position_table(report, text: str) -> Table:
    """Per band of positions in the window: the first model's ppl, each other's ratio to it (the last band is
    the longest context the windows reach: where a method that forgets shows)."""
    rows = [r for r in report.results if r.text == text]
    bands = list(rows[0].ppl_by_position)
    title = f"Perplexity by position in windows of {report.max_length} tokens, {text}: ratio to the first model"
    table = Table(title=title, title_justify="left")
    table.add_column("model")
    for band in bands:
        table.add_column(band, justify="right")
    for index, r in enumerate(rows):
        cells = [f"{r.ppl_by_position[b]:.3f}" if index == 0 else ui.described(f"x{r.ratio_by_position[b]:.3f}",
                                                                                  f"{r.ppl_by_position[b]:.3f}")
                 for b in bands]
        table.add_row(r.model, *cells)
    return table


def domain_table(report) -> Table:
    """Model x text: ppl and ratio to the first model; each model's worst text in bold red."""
    stride = "disjoint" if report.stride == report.max_length else f"stride {report.stride}"
    tokens = f", first {report.max_tokens:,} tokens of each" if report.max_tokens else ""
    title = (f"Perplexity ratio to the first model on the evaluation part of each text{tokens}, windows of "
             f"{report.max_length} tokens, {stride}; worst text in red")
    table = Table(title=title, title_justify="left")
    table.add_column("model")
    for text in report.texts:
        table.add_column(text.removesuffix("-sample"), justify="right")
    table.add_column("worst", justify="right")
    for model, ratios in report.ratios.items():
        first = report.row(model, report.texts[0])
        cells = []
        for text in report.texts:
            r = report.row(model, text)
            cell = Text(f"{r.ppl:.3f}") if model == report.results[0].model else ui.described(f"x{r.ratio:.3f}", f"{r.ppl:.3f}")
            if text == report.worst[model] and len(ratios) > 1 and r.ratio != 1.0:
                cell.stylize("bold red")
            cells.append(cell)
        worst = report.worst[model]
        cells.append("-" if model == report.results[0].model else f"x{ratios[worst]:.3f} {worst.removesuffix('-sample')}")
        table.add_row(ui.described(model, f"{first.model_type}, {first.dtype}, KV {first.kv_bytes_per_token:,} B/token"),
                      *cells)
    return table


# ------------------------------------------------------------------------------------------ eval tasks
@eval_app.command("tasks", epilog=examples(
    "attnsurg eval tasks smollm2-135m out/mla50",
    "attnsurg eval tasks smollm2-135m out/mla50 --tasks facts,passkey --limit 100",
    "attnsurg eval tasks smollm2-135m --tasks passkey --passkey-lengths 512,2048",
    guide="eval.md"))
@user_errors
def eval_tasks(
    models: Annotated[list[str], typer.Argument(help="Models to score, the first as the reference.")],
    tasks: Annotated[str, typer.Option("--tasks", help="Tasks (comma list) or none.",
                                       rich_help_panel=EVALUATION)] = "facts,cloze,passkey",
    lm_eval: Annotated[
        Optional[str], typer.Option("--lm-eval", help="lm-evaluation-harness tasks, comma-separated.",
                                    rich_help_panel=EVALUATION)
    ] = None,
    lm_eval_include: Annotated[
        Optional[Path], typer.Option("--lm-eval-include", help="A folder of extra harness task YAML files.",
                                     rich_help_panel=EVALUATION)
    ] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="At most N items per task (default: all).",
                                                 rich_help_panel=EVALUATION)] = None,
    passkey_lengths: Annotated[
        Optional[str], typer.Option("--passkey-lengths", help="Passkey prompt lengths (default: 512, 1024, ...).",
                                    rich_help_panel=EVALUATION)
    ] = None,
    retrieval_lengths: Annotated[
        Optional[str], typer.Option("--retrieval-lengths", help="Retrieval lengths (default: 1024 to the context).",
                                    rich_help_panel=EVALUATION)
    ] = None,
    retrieval_questions: Annotated[int, typer.Option("--retrieval-questions", help="Retrieval questions per length.",
                                                     rich_help_panel=EVALUATION)] = 80,
    retrieval_variants: Annotated[str, typer.Option(
        "--retrieval-variants", help="multikey, single, multivalue, tracking (a list).",
        rich_help_panel=EVALUATION)] = "multikey",
    dtype: EvalDType = "auto",
    device: EvalDevice = "auto",
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Zero-shot tasks (facts, cloze, passkey, retrieval) and the answers kept."""
    from attnsurg.eval.tasks import parse_tasks, run_tasks
    from attnsurg.requests import ModelRef, TasksEval

    chosen = parse_tasks(tasks)
    if passkey_lengths and "passkey" not in chosen:
        raise UserError("--passkey-lengths applies to the passkey task; add it to --tasks")
    if retrieval_lengths and "retrieval" not in chosen:
        raise UserError("--retrieval-lengths applies to the retrieval task; add it to --tasks")
    if lm_eval_include and not lm_eval:
        raise UserError("--lm-eval-include adds task files for --lm-eval; name the tasks with --lm-eval")

    request = TasksEval(
        models=[ModelRef(ref=m, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle) for m in models],
        tasks=chosen,
        lm_eval=[t.strip() for t in lm_eval.split(",") if t.strip()] if lm_eval else [],
        lm_eval_include=lm_eval_include,
        limit=limit,
        passkey_lengths=parse_int_list(passkey_lengths, "--passkey-lengths") if passkey_lengths else None,
        retrieval_lengths=parse_int_list(retrieval_lengths, "--retrieval-lengths") if retrieval_lengths else None,
        retrieval_questions=retrieval_questions,
        retrieval_variants=[v.strip() for v in retrieval_variants.split(",") if v.strip()],
        dtype=dtype,
        device=device,
    )
    report = run_tasks(request)
    if json_output:
        print(json.dumps(report.to_dict(), indent=2))
        return
    if report.tasks:
        out.print(tasks_table(report))
    if "passkey" in report.tasks:
        out.print(passkey_table(report))
    if "retrieval" in report.tasks:
        out.print(retrieval_table(report))
    if report.lm_eval:
        out.print(harness_table(report))


def parse_int_list(value: str, flag: str) -> list[int]:
    try:
        numbers = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        numbers = []
    if not numbers:
        raise UserError(f"{flag} expects comma-separated integers such as 1024,4096, got '{value}'")
    return numbers


TASK_COLUMNS = {  # (task, metric) -> column title
    ("facts", "choice_acc"): "facts 4-way",
    ("facts", "greedy_acc"): "facts greedy",
    ("cloze", "acc"): "cloze acc",
    ("cloze", "ppl"): "cloze ppl",
    ("passkey", "acc"): "passkey",
    ("retrieval", "acc"): "retrieval",
}


def kept_text(kept: float) -> str:
    return "-" if math.isnan(kept) else f"{kept:.3f}"  # nan: the first model got none right


def task_cell(model, task: str, metric: str, first: bool) -> str | Text:
    result = model.results.get(task)
    if result is None:
        return "-"
    value = result.metrics[metric]
    cell = f"{value:.2f}" if metric == "ppl" else f"{value:.3f}"
    kept = model.retained.get(task, {}).get(metric)
    return cell if first or kept is None else ui.described(cell, f"keeps {kept_text(kept)}")


def tasks_table(report) -> Table:
    columns = [(t, m) for (t, m) in TASK_COLUMNS if t in report.tasks]
    items = ", ".join(f"{t} {int(report.models[0].results[t].metrics['items'])}" for t in report.tasks)
    table = Table(title=f"Zero-shot tasks ({items} items); 'keeps': share of the first model's right answers kept",
                  title_justify="left")
    table.add_column("model")
    for column in columns:
        table.add_column(TASK_COLUMNS[column], justify="right")
    table.add_column("seconds", justify="right")
    for index, model in enumerate(report.models):
        seconds = sum(r.seconds for r in model.results.values())
        table.add_row(ui.described(model.model, f"{model.model_type}, {model.dtype}, {model.device}"),
                      *(task_cell(model, t, m, index == 0) for t, m in columns), f"{seconds:.0f}")
    return table


def harness_table(report) -> Table:
    """Each lm-evaluation-harness task's accuracy-like metrics, with the share of the first model's right answers kept."""
    table = Table(title="lm-evaluation-harness (its own scoring); 'keeps': share of the first model's right answers kept",
                  title_justify="left")
    table.add_column("model")
    columns = [(task, metric) for task, result in report.models[0].harness.items() for metric in result["metrics"]
               if metric.split(",")[0] in ("acc", "acc_norm", "exact_match")]
    for task, metric in columns:
        table.add_column(f"{task} {metric.split(',')[0]}", justify="right")
    for index, model in enumerate(report.models):
        cells = []
        for task, metric in columns:
            value = model.harness[task]["metrics"][metric]
            kept = model.harness_retained.get(task, {}).get(metric.split(",")[0])
            cells.append(f"{value:.3f}" if index == 0 or kept is None else ui.described(f"{value:.3f}", f"keeps {kept_text(kept)}"))
        table.add_row(model.model, *cells)
    return table


def passkey_table(report) -> Table:
    lengths = list(report.models[0].results["passkey"].details["acc_by_length"])
    table = Table(title="Passkey retrieval by prompt length (5 depths each)", title_justify="left")
    table.add_column("model")
    for length in lengths:
        table.add_column(f"{int(length):,}", justify="right")
    for model in report.models:
        by_length = model.results["passkey"].details["acc_by_length"]
        table.add_row(model.model, *(f"{by_length[n]:.1f}" for n in lengths))
    return table


def retrieval_table(report) -> Table:
    """Per length: the share of questions answered, its standard error and (beside the first model) the share
    of the first model's right answers kept."""
    first = report.models[0].results["retrieval"].details
    rows = list(first["acc_by_length"])
    table = Table(title=f"Retrieval by prompt length ({first['questions_by_length'][rows[0]]} questions each; "
                        "rate ± standard error)", title_justify="left")
    table.add_column("model")
    for row in rows:
        table.add_column(row if not row.isdigit() else f"{int(row):,}", justify="right")
    for index, model in enumerate(report.models):
        details = model.results["retrieval"].details
        cells = []
        for row in rows:
            cell = f"{details['acc_by_length'][row]:.2f} ± {details['stderr_by_length'][row]:.2f}"
            kept = model.retained.get("retrieval", {}).get(f"acc {row}")
            cells.append(cell if index == 0 or kept is None else ui.described(cell, f"keeps {kept_text(kept)}"))
        table.add_row(model.model, *cells)
    return table


# ------------------------------------------------------------------------------------------ eval speed
@eval_app.command("speed", epilog=examples(
    "attnsurg eval speed smollm2-135m out/mla50",
    "attnsurg eval speed smollm2-135m out/mla50 --context 512,2048 --repeats 5",
    "attnsurg eval speed smollm2-135m out/mla50 --context 4096 --batch 8",
    guide="eval.md"))
@user_errors
def eval_speed(
    models: Annotated[list[str], typer.Argument(help="Models to time, the first as the reference.")],
    context: Annotated[str, typer.Option("--context", help="Prompt lengths in tokens, comma-separated.",
                                         rich_help_panel=EVALUATION)] = "1024,4096",
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Greedy decode steps after each prefill.",
                                            rich_help_panel=EVALUATION)] = 64,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repetitions (medians are reported).",
                                         rich_help_panel=EVALUATION)] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed runs per context before timing.",
                                        rich_help_panel=EVALUATION)] = 1,
    batch: Annotated[int, typer.Option("--batch", help="Sequences prefilled and decoded together.",
                                       rich_help_panel=EVALUATION)] = 1,
    runtime: Annotated[str, typer.Option(
        "--runtime", help="MLA runtimes timed: attnsurg, stock, or both.",
        rich_help_panel=EVALUATION)] = "attnsurg,stock",
    dtype: EvalDType = "auto",
    device: EvalDevice = "auto",
    seed: Annotated[int, typer.Option("--seed", help="Random seed of the prompt tokens.", rich_help_panel=OUTPUT)] = 0,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Prefill and decode speed, KV cache held and peak memory, side by side."""
    from attnsurg.eval.speed import run_speed
    from attnsurg.requests import ModelRef, SpeedEval

    request = SpeedEval(
        models=[ModelRef(ref=m, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle) for m in models],
        contexts=parse_int_list(context, "--context"),
        new_tokens=new_tokens,
        repeats=repeats,
        warmup=warmup,
        batch=batch,
        runtimes=parse_runtimes(runtime),
        dtype=dtype,
        device=device,
        seed=seed,
    )
    report = run_speed(request)
    if json_output:
        print(json.dumps(report.to_dict(), indent=2))
        return
    out.print(speed_table(report))


def speed_table(report) -> Table:
    batch = f"batch {report.batch}, " if report.batch > 1 else ""
    title = (f"Speed: prefill, then {report.new_tokens} greedy decode steps; {batch}medians of {report.repeats}; "
             f"ratios to the first model; memory: {report.memory_note}")
    table = Table(title=title, title_justify="left")
    for column in ("model", "context", "prefill tok/s", "decode tok/s", "KV cache held", "KV B/token (config)", "peak memory"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for index, model in enumerate(report.models):
        for c in model.contexts:
            ratio = model.ratios[str(c.context)]
            show = index > 0
            peak = "-" if c.peak_memory_bytes is None else f"{c.peak_memory_bytes / 2**30:.2f} GiB"
            table.add_row(
                ui.described(model.model, described_run(model)) if c is model.contexts[0] else "",
                f"{c.context:,}",
                f"{c.prefill_tokens_per_second:,.0f}" + (f" (x{ratio['prefill']:.2f})" if show else ""),
                f"{c.decode_tokens_per_second:,.1f}" + (f" (x{ratio['decode']:.2f})" if show else ""),
                f"{c.kv_cache_bytes / 2**20:,.1f} MiB" + (f" (x{ratio['kv_cache']:.3f})" if show else ""),
                f"{c.kv_bytes_per_token:,.0f} ({model.predicted_kv_bytes_per_token:,})",
                peak,
            )
    return table


def described_run(model) -> str:
    runtime = f", {model.runtime} runtime" if model.runtime else ""
    return f"{model.model_type}, {model.dtype}, {model.device}{runtime}"


def parse_runtimes(text: str) -> list[str]:
    from attnsurg.modeling.absorbed import RUNTIMES

    runtimes = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown or not runtimes:
        raise UserError(f"--runtime: '{unknown[0] if unknown else text}' is not a runtime; "
                        f"use {' or '.join(RUNTIMES)}, or both comma-separated")
    return runtimes
