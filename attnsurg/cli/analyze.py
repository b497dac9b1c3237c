"""`attnsurg analyze`: spectra, RoPE energy and sparsity of a model's attention, with plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from typer.core import TyperGroup

from attnsurg.cli.common import (
    AllowPickle,
    CalibDataset,
    CalibSeqLen,
    CalibText,
    CalibTokens,
    DEFAULT_EVAL_DOMAINS,
    EVALUATION,
    MARKUP,
    PLAN,
    Device,
    JsonFlag,
    Overwrite,
    TrustRemoteCode,
    app,
    out,
    eval_domains_from,
    examples,
    user_errors,
)
from attnsurg.errors import UserError
from attnsurg.requests import EVAL_DOMAINS


def parse_layers(value: str) -> list[int] | None:
    """``all`` or a comma list of layer indices and ranges (``0,4,8-11``)."""
    if value.strip().lower() == "all":
        return None
    layers = []
    try:
        for part in value.split(","):
            first, _, last = part.strip().partition("-")
            span = range(int(first), int(last or first) + 1)
            if not span:
                raise ValueError(part)
            layers.extend(span)
    except ValueError:
        raise UserError(f"--layers '{value}': give all, or layer indices and ranges such as 0,4,8-11") from None
    return layers


class DefaultReport(TyperGroup):
    """``attnsurg analyze MODEL`` runs the ``report`` subcommand; ``attnsurg analyze approx MODEL`` the other."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["report", *args]
        return super().parse_args(ctx, args)


analyze_app = typer.Typer(
    cls=DefaultReport, no_args_is_help=True, rich_markup_mode=MARKUP,
    help="The numerical lens on attention: spectra, approximations, budgets.",
    epilog=examples("attnsurg analyze smollm2-135m -o out/analysis",
                    "attnsurg analyze approx smollm2-135m -o out/approx",
                    "attnsurg analyze plan smollm2-135m --target-ratio 1.3 -o out/plan", guide="analyze.md"))
app.add_typer(analyze_app, name="analyze")

ModelArgument = Annotated[str, typer.Argument(help="Checkpoint directory, .gguf, hub id or built-in name.")]
DATA, ANALYSIS = "Data", "Analysis"
Dataset = Annotated[str, typer.Option("--dataset", help="Built-in texts (comma list) or all.", rich_help_panel=DATA)]
TextFile = Annotated[Path | None, typer.Option("--text", help="A UTF-8 file to read instead.", rich_help_panel=DATA)]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per window.", rich_help_panel=DATA)]
Layers = Annotated[str, typer.Option("--layers", help="all, or layers such as 0,4,8-11.", rich_help_panel=ANALYSIS)]


def text_data(dataset: str, text: Path | None):
    from attnsurg.requests import TextData

    return TextData(dataset=None if text else dataset, text=text, part="calib")


@analyze_app.command("report", epilog=examples(
    "attnsurg analyze smollm2-135m -o out/analysis",
    "attnsurg analyze report smollm2-135m --layers 0,4,8-11 -o out/layers",
    guide="analyze.md"))
@user_errors
def analyze(
    model: ModelArgument,
    output: Annotated[Path, typer.Option("--output", "-o", help="Report directory (plots, analysis.json).")],
    dataset: Dataset = "wiki-sample",
    text: TextFile = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens the activation spectra are measured on.",
                                        rich_help_panel=DATA)] = 8192,
    seq_len: SeqLen = 1024,
    layers: Layers = "all",
    attention_windows: Annotated[int, typer.Option("--attention-windows", help="Windows whose attention maps are analysed.",
                                                   rich_help_panel=ANALYSIS)] = 2,
    device: Device = "auto",
    overwrite: Overwrite = False,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Spectra, RoPE energy and sparsity of a model's attention: plots and JSON."""
    from attnsurg.analyze import run_analysis
    from attnsurg.requests import AnalyzeRequest, ModelRef

    request = AnalyzeRequest(
        model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle), output=output,
        data=text_data(dataset, text), tokens=tokens, seq_len=seq_len,
        layers=parse_layers(layers), attention_windows=attention_windows, device=device, overwrite=overwrite)
    report, files = run_analysis(request)
    if json_output:
        print(json.dumps({"report": str(files[0]), "files": [str(f) for f in files], "seconds": report.seconds,
                          "layers": headline_rows(report)}, indent=2))
        return
    out.print(headline_table(report))
    for line in headline_summary(report):
        out.print(line, highlight=False)
    out.print(f"Wrote {len(files)} files to {output} in {report.seconds:.0f} s", highlight=False)


def mean(values) -> float:
    return statistics.fmean(values)


def headline_rows(report) -> list[dict]:
    """Per layer, mean over heads: ranks holding 90/99% of the energy and the attention's concentration."""
    rows = []
    for layer in report.layers:
        rows.append({
            "layer": layer.index,
            "key_rank90_pre": mean(s.rank90 for s in layer.keys_pre_rope),
            "key_rank99_pre": mean(s.rank99 for s in layer.keys_pre_rope),
            "key_rank99_post": mean(s.rank99 for s in layer.keys_post_rope),
            "value_rank99": mean(s.rank99 for s in layer.values),
            "kv_joint_rank99": layer.kv_joint.rank99,
            "kv_joint_size": layer.kv_joint.size,
            "attention_rank90": mean(h.attention.rank90 for h in layer.heads),
            "top5_mass": mean(h.top["5%"] for h in layer.heads),
            "sink": mean(h.sink for h in layer.heads),
        })
    return rows


def headline_table(report) -> Table:
    d = report.head_dim
    table = Table(title=f"{report.model}: attention on {report.tokens:,} tokens of {report.text} (mean over heads)",
                  title_justify="left")
    for column in ("layer", f"K r90/r99 of {d}", "K after RoPE r99", f"V r99 of {d}", "K,V joint r99",
                   f"attention r90 of {report.seq_len}", "top-5% mass", "sink"):
        table.add_column(column, justify="right")
    for r in headline_rows(report):
        table.add_row(str(r["layer"]), f"{r['key_rank90_pre']:.0f} / {r['key_rank99_pre']:.0f}", f"{r['key_rank99_post']:.0f}",
                      f"{r['value_rank99']:.0f}", f"{r['kv_joint_rank99']} of {r['kv_joint_size']}",
                      f"{r['attention_rank90']:.0f}", f"{r['top5_mass']:.2f}", f"{r['sink']:.2f}")
    return table


def headline_summary(report) -> list[str]:
    """What the measurements say about the methods, in a few lines."""
    rows = headline_rows(report)
    joint = statistics.median(r["kv_joint_rank99"] / r["kv_joint_size"] for r in rows)
    keys = statistics.median(r["key_rank99_post"] for r in rows)
    top5 = mean(r["top5_mass"] for r in rows)
    return [
        f"K and V of all heads: median rank holding 99% of the energy {joint:.0%} of their width "
        "(the share of the KV cache a joint latent, as in MLA, keeps at that energy)",
        f"keys after RoPE: median rank holding 99% of the energy {keys:.0f} of {report.head_dim} (a Loki scoring rank)",
        f"the strongest 5% of keys hold {top5:.0%} of the attention mass on average (top-k attention keeps that much)",
    ]


def parse_budgets(value: str) -> list[float]:
    """Comma list of shares: 0.25, 1/16."""
    try:
        return [float(part) if "/" not in part else float(part.split("/")[0]) / float(part.split("/")[1])
                for part in value.split(",")]
    except (ValueError, ZeroDivisionError):
        raise UserError(f"--budgets '{value}': give shares of exact attention's cost, such as 1/16,1/8,1/4") from None


@analyze_app.command("approx", epilog=examples(
    "attnsurg analyze approx smollm2-135m -o out/approx",
    "attnsurg analyze approx smollm2-135m --budgets 1/32,1/8 -o out/approx",
    guide="analyze.md"))
@user_errors
def approx(
    model: ModelArgument,
    output: Annotated[Path, typer.Option("--output", "-o", help="Report directory (approx.png, approx.json).")],
    dataset: Dataset = "wiki-sample",
    text: TextFile = None,
    seq_len: SeqLen = 1024,
    layers: Annotated[str, typer.Option("--layers", help="all or 0,4,8-11 (default: first, middle, last).",
                                        rich_help_panel=ANALYSIS)] = "",
    budgets: Annotated[str, typer.Option("--budgets", help="Shares of exact attention's cost.",
                                         rich_help_panel=ANALYSIS)] = "1/16,1/8,1/4",
    device: Device = "auto",
    overwrite: Overwrite = False,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Attention approximations on the model's own Q, K, V at equal budgets."""
    from attnsurg.analyze.run import run_approx
    from attnsurg.requests import ApproxRequest, ModelRef

    request = ApproxRequest(
        model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle), output=output,
        data=text_data(dataset, text), seq_len=seq_len, layers=parse_layers(layers) if layers else [],
        budgets=parse_budgets(budgets), device=device, overwrite=overwrite)
    report, files = run_approx(request)
    if json_output:
        print(json.dumps({"report": str(files[0]), "files": [str(f) for f in files], **report.model_dump()}, indent=2))
        return
    out.print(approx_table(report))
    if report.bidirectional:
        out.print(f"{', '.join(report.bidirectional)}: measured against bidirectional attention (no causal form)",
                  highlight=False)
    out.print(f"Wrote {len(files)} files to {output} in {report.seconds:.0f} s", highlight=False)


@analyze_app.command("plan", epilog=examples(
    "attnsurg analyze plan smollm2-135m --target-ratio 1.3 -o out/plan",
    "attnsurg analyze plan smollm2-135m --methods mla,svdllm --verify -o out/plan",
    guide="analyze.md"))
@user_errors
def plan(
    model: ModelArgument,
    output: Annotated[Path, typer.Option("--output", "-o", help="Plan directory (plan.json, plan.png, recipes).")],
    target_ratio: Annotated[float, typer.Option("--target-ratio", help="Largest perplexity ratio to the source allowed.",
                                                rich_help_panel=PLAN)] = 1.3,
    methods: Annotated[str, typer.Option("--methods", help="svd, asvd, svdllm, loki, mla, tucker, cp or linear.",
                                         rich_help_panel=PLAN)] = "svdllm,loki,mla",
    dataset: CalibDataset = "wiki-sample",
    text: CalibText = None,
    calib_tokens: CalibTokens = 4096,
    seq_len: CalibSeqLen = 512,
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", help="Eval-part tokens each ratio is scored on.",
                                             rich_help_panel=EVALUATION)] = 2048,
    eval_domains: Annotated[str, typer.Option(
        "--eval-domains", help="Texts the target must hold on: a comma list, all, none.", rich_help_panel=EVALUATION,
        show_default=", ".join(EVAL_DOMAINS))] = DEFAULT_EVAL_DOMAINS,
    verify: Annotated[bool, typer.Option("--verify", help="Also convert each chosen budget and measure it.",
                                         rich_help_panel=PLAN)] = False,
    device: Device = "auto",
    overwrite: Overwrite = False,
    json_output: JsonFlag = False,
    trust_remote_code: TrustRemoteCode = False,
    allow_pickle: AllowPickle = False,
) -> None:
    """Per method, the smallest budget predicted within a perplexity ratio."""
    from attnsurg.analyze.plan import parse_methods, run_plan
    from attnsurg.requests import Calibration, ModelRef, PlanRequest

    request = PlanRequest(
        model=ModelRef(ref=model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle), output=output,
        target_ratio=target_ratio, methods=parse_methods(methods),
        calibration=Calibration(data=text_data(dataset, text), tokens=calib_tokens, seq_len=seq_len),
        eval_tokens=eval_tokens, eval_domains=eval_domains_from(eval_domains), verify=verify, device=device,
        overwrite=overwrite)
    report, files = run_plan(request)
    if json_output:
        print(json.dumps({"report": str(files[0]), "files": [str(f) for f in files], **report.model_dump()}, indent=2))
        return
    out.print(plan_table(report))
    out.print(f"Wrote {len(files)} files to {output} in {report.seconds:.0f} s", highlight=False)


def plan_table(report) -> Table:
    texts = list(report.ppl_source)
    scope = texts[0] if len(texts) == 1 else f"the worst of {', '.join(texts)}"
    table = Table(title=f"{report.model}: smallest budget predicted within x{report.target_ratio:g} on {scope} "
                        f"({report.eval_tokens} tokens each)", title_justify="left")
    for column in ("method", "anchors (budget: worst measured)", "error model", "budget", "predicted", "measured (worst)"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for m in report.methods:
        anchors = ", ".join(anchor_text(a, texts) for a in m.anchors)
        model = f"ln r = {m.scale:.3g} e^{m.power:.2f}"
        if m.floor is not None:
            model = f"ln r = ln {m.floor.ratio:.3f} + {m.scale:.3g} e^{m.power:.2f}"
        chosen = "none" if m.chosen is None else f"{m.chosen:g}"
        predicted = "" if m.predicted_ratio is None else f"x{m.predicted_ratio:.3f}"
        measured = "" if m.measured_ratio is None else (
            f"x{m.measured_ratio:.3f}{worst_text(m.measured_ratios, texts)} "
            + ("(an anchor)" if m.chosen_is_anchor else f"({m.relative_difference:+.1%})"))
        table.add_row(m.method, anchors, model, chosen, predicted, measured)
    return table


def anchor_text(anchor, texts: list[str]) -> str:
    """'0.5: x1.293 code-sample', with the prediction made there before it was converted, and whether the final
    error model goes through it."""
    text = f"{anchor.budget:g}: x{anchor.ratio:.3f}{worst_text(anchor.ratios, texts)}"
    if anchor.predicted is not None:
        text += f" (predicted x{anchor.predicted:.3f})"
    return text if anchor.fitted else f"{text} (not fitted)"


def worst_text(ratios: dict[str, float] | None, texts: list[str]) -> str:
    """' c4-sample': which text a worst ratio came from, when there is more than one."""
    if not ratios or len(texts) < 2:
        return ""
    return f" {max(ratios, key=ratios.get)}"


def approx_table(report) -> Table:
    """Family x budget: the relative output error, mean over the analysed layers and their heads."""
    layers = ", ".join(str(layer.index) for layer in report.layers)
    table = Table(title=f"{report.model}: ||O~ - O|| / ||O|| on {report.seq_len} tokens of {report.text}, "
                        f"mean over layers {layers}", title_justify="left")
    table.add_column("family")
    for budget in report.budgets:
        table.add_column(f"budget {budget:.3g}", justify="right")
    families = report.layers[0].errors
    for family in families:
        errors = [mean(layer.errors[family][i] for layer in report.layers) for i in range(len(report.budgets))]
        table.add_row(family, *(f"{e:.3f}" for e in errors))
    return table
