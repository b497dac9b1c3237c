"""Running a recipe from a command, and printing what the surgery reports."""

from __future__ import annotations

import json

from rich.text import Text

from attnsurg.cli.common import out
from attnsurg.errors import UserError


def execute(recipe, dry_run: bool, overwrite: bool, print_recipe: bool, json_output: bool, device: str = "auto") -> None:
    """Run a recipe (what every surgery command does) on ``device`` and print its report."""
    from attnsurg.io.recipe_file import dump_recipe
    from attnsurg.pipelines.processes import is_main_process
    from attnsurg.pipelines.run import run_recipe

    if print_recipe and json_output:
        raise UserError("--print-recipe and --json both write to stdout; pass one of them")
    if print_recipe:
        print(dump_recipe(recipe), end="")
        if dry_run:
            return
    report = run_recipe(recipe, dry_run=dry_run, overwrite=overwrite, device=device)
    if is_main_process():  # under `accelerate launch` the main process reports
        print_report(recipe, report, dry_run, json_output)


def print_report(recipe, report, dry_run: bool, json_output: bool) -> None:
    from attnsurg.pipelines.run import HealRunReport

    if isinstance(report, HealRunReport):
        print_heal_report(recipe, report, dry_run, json_output)
    else:
        print_surgery_report(recipe.model.ref, report, dry_run, json_output)


def streamed_note(report) -> str:
    return ", the source read one layer at a time" if report.streamed else ", the source loaded whole"


def domains_record(report, first: str = "before") -> dict:
    """ppl off the calibration text per domain (``first``: what the first figure is), and the worst domain."""
    from attnsurg.pipelines.scoring import worst_domain

    scores = report.domains
    record = {name: {first: before, "after": after, "ratio": after / before} for name, (before, after) in scores.items()}
    return {"scores": record, "worst": worst_domain(scores)}


def long_context_record(report) -> dict | None:
    if getattr(report, "long_context", None) is None:
        return None
    before, after = report.long_context
    return {"length": before.length, "band": before.band, "hits_before": before.hits, "hits_after": after.hits,
            "late_ppl_before": before.late_ppl, "late_ppl_after": after.late_ppl}


def print_domains(report, before: str = "") -> None:
    """One line per evaluation domain off the calibration text, the worst marked."""
    from attnsurg.pipelines.scoring import worst_domain

    worst = worst_domain(report.domains)
    for name, (first, after) in report.domains.items():
        mark = ("  worst domain", "bold red") if name == worst and len(report.domains) > 1 else ""
        of = f" of the {before}" if before else ""
        out.print(Text.assemble(f"  {name}: ppl {first:.3f} -> {after:.3f} (x{after / first:.3f}{of})", mark), highlight=False)


def print_ppl(report) -> None:
    if report.ppl_before is None:
        return
    start = getattr(getattr(report, "heal", None), "ppl_start", None)
    surgery = f"{start:.3f} (x{start / report.ppl_before:.3f}) after the surgery, " if start is not None else ""
    healed = " after healing" if surgery else ""
    out.print(f"ppl {report.ppl_before:.3f} -> {surgery}{report.ppl_after:.3f}{healed} (x{report.ppl_after / report.ppl_before:.3f}) "
              "on the calibration text's eval part")
    print_domains(report)


def print_long_context(report) -> None:
    if getattr(report, "long_context", None) is not None:
        from attnsurg.eval.long_context import long_context_line

        out.print(long_context_line(*report.long_context), highlight=False)


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


def print_surgery_report(model: str, report, dry_run: bool, json_output: bool) -> None:
    """The method's own figures (``SurgeryMethod.report_record`` / ``report_text``), then what every run has."""
    from attnsurg.methods.base import method_of

    method = method_of(report.plan)
    if json_output:
        record = method.report_record(report) | {
            "written": report.written, "seconds": report.seconds, method.seconds_key: report.operation_seconds,
            "peak_memory_gb": report.peak_memory_gb, "ppl_before": report.ppl_before, "ppl_after": report.ppl_after,
            "heal": heal_record(report.heal), "domains": domains_record(report), "streamed": report.streamed,
            "long_context": long_context_record(report)}
        print(json.dumps(record, indent=2))
        return
    for renderable in method.report_text(model, report, dry_run):
        out.print(renderable)
    if report.written:
        timed = f" ({method.timed_step} {report.operation_seconds:.1f} s, calibration included)" if method.timed_step else ""
        out.print(f"wrote {report.written} in {report.seconds:.1f} s{timed}, peak memory {report.peak_memory_gb:.2f} GB"
                  + streamed_note(report))
    for line in method.result_text(report):
        out.print(line)
    print_heal_summary(report.heal)
    print_ppl(report)
    print_long_context(report)


def print_heal_report(recipe, report, dry_run: bool, json_output: bool) -> None:
    settings = recipe.heal
    if json_output:
        record = {"written": report.written, "seconds": report.seconds, "peak_memory_gb": report.peak_memory_gb,
                  "ppl_teacher": report.ppl_teacher, "ppl_before": report.ppl_before, "ppl_after": report.ppl_after,
                  "heal": heal_record(report.heal), "domains": domains_record(report, first="teacher")}
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
        print_domains(report, before="teacher")
