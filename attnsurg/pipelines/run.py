"""``attnsurg run RECIPE``: execute a recipe. ``convert``, ``compress`` and ``heal`` build the same
:class:`~attnsurg.recipe.Recipe` from their flags and come through here, so a command and its recipe
are one thing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.errors import UserError
from attnsurg.eval.perplexity import perplexity_of, scoring_windows
from attnsurg.heal import (
    HealReport,
    fitted_to_context,
    heal_model,
    heal_state_dir,
    process_state,
    remove_heal_state,
    training_windows,
)
from attnsurg.info import inspect_model
from attnsurg.io.card import CardInfo
from attnsurg.io.recipe_file import RECIPE_FILE, dump_recipe
from attnsurg.io.load import load_tokenizer, resolve_device
from attnsurg.io.guard import check_output_path
from attnsurg.io.save import write_checkpoint
from attnsurg.modeling import MODEL_TYPES as ATTNSURG_MODEL_TYPES
from attnsurg.modeling import MODELING_FILE
from attnsurg.pipelines.card import add_healing, base_model_id, command_line, peak_memory_gb, source_license
from attnsurg.pipelines.processes import is_main_process
from attnsurg.pipelines.scoring import domain_rows, domain_texts, fetch_domains, perplexity_row, score_domains
from attnsurg.pipelines.source import load_source, to_source_dtype
from attnsurg.pipelines.job import Job, read_paths
from attnsurg.pipelines.surgery import run_surgery
from attnsurg.recipe import Recipe
from attnsurg.requests import ModelRef


def check_permissions(recipe: Recipe, trust_remote_code: bool, allow_pickle: bool) -> None:
    """A recipe cannot grant itself remote code or pickle loading: the command line must agree."""
    refs = [recipe.model] + ([recipe.heal.teacher] if recipe.heal and recipe.heal.teacher else [])
    for ref in refs:
        if ref.trust_remote_code and not trust_remote_code:
            raise UserError(f"the recipe trusts remote code of '{ref.ref}'; pass --trust-remote-code to allow it")
        if ref.allow_pickle and not allow_pickle:
            raise UserError(f"the recipe allows pickle weights for '{ref.ref}'; pass --allow-pickle to allow it")


def run_recipe(recipe: Recipe, dry_run: bool = False, overwrite: bool = False, device: str = "auto"):
    """Run the recipe's surgery (with its healing), or a heal-only recipe, on ``device`` (auto: a CUDA GPU
    when there is one); returns the command's report."""
    state = process_state(resolve_device(device))  # a device this machine lacks fails before any work
    if state.num_processes > 1 and recipe.heal is None:
        raise UserError("several processes (accelerate launch, torchrun) share healing only, and this recipe has no "
                        "heal step: run it as one process")
    if recipe.surgery is None:
        return run_heal(recipe, dry_run, overwrite, device)
    return run_surgery(Job(recipe, overwrite, device), dry_run)


@dataclass
class HealRunReport:
    anatomy: AttentionAnatomy
    heal: HealReport | None = None
    written: str | None = None
    seconds: float = 0.0
    peak_memory_gb: float = 0.0
    ppl_teacher: float | None = None
    ppl_before: float | None = None
    ppl_after: float | None = None
    domains: dict[str, tuple[float, float]] = field(default_factory=dict)  # teacher and healed student


def run_heal(recipe: Recipe, dry_run: bool = False, overwrite: bool = False, device: str = "auto") -> HealRunReport:
    """``attnsurg heal STUDENT --teacher ORIGINAL``: distil, score teacher/before/after, write."""
    settings = recipe.heal
    compute = resolve_device(device)
    main = process_state(compute).is_main_process  # before any model moves: each process takes its own GPU
    student_source, student_config, anatomy = inspect_model(recipe.model)
    teacher_source, teacher_config, _ = inspect_model(settings.teacher)
    reads = read_paths(recipe, student_source, teacher_source)
    check_output_path(recipe.output, overwrite, reads)
    if student_config.vocab_size != teacher_config.vocab_size:
        raise UserError(
            f"student and teacher vocabularies differ ({student_config.vocab_size} vs {teacher_config.vocab_size}); "
            "heal against the model the student was made from"
        )
    settings = fitted_to_context(settings, anatomy.max_positions)
    recipe = recipe.with_heal(settings)
    report = HealRunReport(anatomy)
    domains = domain_texts(recipe.calibration.data, recipe.eval.domains, recipe.eval.tokens)
    if dry_run:
        return report
    fetch_domains(domains)
    training_windows(load_tokenizer(student_source, recipe.model.trust_remote_code), settings.data,
                     settings.seq_len)  # a text that cannot train is refused before the models load
    started = time.perf_counter()
    student, tokenizer = load_source(recipe.model, student_source)
    teacher, _ = load_source(settings.teacher, teacher_source)
    held_out = None
    if recipe.eval.tokens and main:
        held_out = scoring_windows(tokenizer, recipe.calibration.data, recipe.eval.tokens, anatomy.max_positions)
        report.ppl_teacher = perplexity_of(teacher, *held_out, "the teacher", compute)
        report.ppl_before = perplexity_of(student, *held_out, "the student", compute)
    report.heal = heal_model(student, teacher, tokenizer, settings, recipe.seed, heal_state_dir(recipe.output), device=compute)
    if not is_main_process():  # under `accelerate launch`, one process scores and writes
        return report
    if held_out is not None:
        report.ppl_after = perplexity_of(student, *held_out, "the healed student", compute)
        report.domains = score_domains(teacher, student, tokenizer, domains, recipe.eval.tokens, anatomy.max_positions,
                                       compute)
    to_source_dtype(student, anatomy)
    report.seconds = time.perf_counter() - started
    report.peak_memory_gb = peak_memory_gb()
    files = {RECIPE_FILE: dump_recipe(recipe)}
    if anatomy.model_type in ATTNSURG_MODEL_TYPES:
        files[MODELING_FILE.name] = MODELING_FILE.read_text(encoding="utf-8")
    card = heal_card(recipe, report, remote_code=anatomy.model_type in ATTNSURG_MODEL_TYPES)
    report.written = str(write_checkpoint(student, tokenizer, recipe.output, card, overwrite, extra_files=files,
                                           reads=reads))
    remove_heal_state(heal_state_dir(recipe.output))
    return report


def heal_card(recipe: Recipe, report: HealRunReport, remote_code: bool = False) -> CardInfo:
    teacher: ModelRef = recipe.heal.teacher
    figures = []
    if report.ppl_before is not None:
        figures.append(perplexity_row(recipe.calibration.data, recipe.eval.tokens, report.ppl_before, report.ppl_after,
                                      f" (teacher {report.ppl_teacher:.3f})"))
        figures.extend(domain_rows(report.domains, recipe.eval.tokens, before="teacher"))
    info = CardInfo(
        title=f"{recipe.model.ref}, healed by distillation from {teacher.ref}",
        summary=(
            "The attention of this checkpoint was trained by attnsurg to match the teacher's next-token "
            "distribution; the architecture and its KV cache are the student's, unchanged."
        ),
        base_model=base_model_id(teacher.ref),
        command=command_line(),
        figures=figures,
        license=source_license(teacher.ref),
        remote_code=remote_code,
    )
    add_healing(info, report.heal, recipe.heal)
    return info
