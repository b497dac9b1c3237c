"""Finishing a surgery: heal where the recipe says so, score before and after, and write the checkpoint with its
card (``finish_surgery``), or complete a streamed one's shards (``finish_streamed``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from transformers import PretrainedConfig, PreTrainedModel

from attnsurg.arch.anatomy import AttentionAnatomy, meta_model
from attnsurg.eval.perplexity import perplexity_of
from attnsurg.heal import heal_model, heal_state_dir, remove_heal_state
from attnsurg.io.card import CardInfo
from attnsurg.io.lazy import OFFLOADED, scoring_model
from attnsurg.io.load import load_config
from attnsurg.io.save import finish_staging, write_checkpoint
from attnsurg.io.recipe_file import RECIPE_FILE, dump_recipe
from attnsurg.pipelines.job import Job
from attnsurg.pipelines.card import add_healing, generation_config, parameter_rows, peak_memory_gb, source_license, source_note
from attnsurg.pipelines.processes import is_main_process
from attnsurg.pipelines.scoring import add_score_rows, long_context_of, perplexities, record_scores, scored_texts
from attnsurg.pipelines.source import Surgery, to_source_dtype


def finish_streamed(staging: Path, written: PretrainedConfig, source, surgery: Surgery, job: Job, report,
                    card: Callable[[], CardInfo], extra_files: dict[str, str] | None = None) -> None:
    """Config, generation settings, tokenizer, card and recipe beside the streamed shards; the source and the
    staged output scored before and after on the same windows, each loaded whole where it fits easily in memory
    and read a module at a time where it does not (``io.lazy.scoring_model``)."""
    written.save_pretrained(staging)
    generation_config(source.path, written).save_pretrained(staging)
    recipe = job.recipe
    texts = scored_texts(surgery.tokenizer, job, report.anatomy)
    offloaded = False
    if texts or recipe.eval.long_context:
        scores, checks = [], []
        for label, path in (("the source", Path(source.path)), ("the result", staging)):
            model = scoring_model(path, surgery.device)  # one model in memory at a time
            offloaded |= hasattr(model, OFFLOADED)
            scores.append(perplexities(model, texts, label))
            if not offloaded:  # the long-context check reads a cache: not through disk offload
                checks.append(long_context_of(model, surgery.tokenizer, job, label))
            del model
        if texts:
            record_scores(report, texts, *scores)
        report.long_context = tuple(checks) if len(checks) == 2 and None not in checks else None
    info = card()
    info.license = info.license or source_license(recipe.model.ref)
    info.remote_code = bool(getattr(written, "auto_map", None))
    if note := source_note(recipe.model.ref):
        info.details.insert(0, note)
    trust = recipe.model.trust_remote_code
    info.figures[:0] = parameter_rows(meta_model(load_config(source, trust), trust), meta_model(written, trust),
                                      surgery.family.attention_attr)  # counted on the meta device: nothing allocated
    add_score_rows(info, job, report)
    info.details.append("written one decoder layer at a time (`--stream`)"
                        + ("; scored with one module of each model in memory at a time" if offloaded else ""))
    finish_staging(staging, surgery.tokenizer, info, {RECIPE_FILE: dump_recipe(recipe), **(extra_files or {})})


def finish_surgery(
    surgery: Surgery, result: PreTrainedModel, job: Job, anatomy: AttentionAnatomy, report,
    card: Callable[[], CardInfo], extra_files: dict[str, str] | None = None,
) -> None:
    """Heal if the recipe says so, score before/after on the same windows, cast to the source dtype, fill
    the report's timing and write the checkpoint with its card and the recipe that made it."""
    recipe = job.recipe
    texts = scored_texts(surgery.tokenizer, job, anatomy)  # one set of windows scores the source, the result and the healed one
    if recipe.heal is not None:
        before_healing = (perplexity_of(result, *texts[0][1:], "the result before healing", surgery.device)
                          if texts else None)
        report.heal = heal_model(result, surgery.model, surgery.tokenizer, recipe.heal, job.recipe.seed,
                                 heal_state_dir(job.recipe.output), device=surgery.device)
        report.heal.ppl_start = before_healing
        if not is_main_process():  # under `accelerate launch`, one process scores and writes
            return
    if texts:
        record_scores(report, texts, perplexities(surgery.model, texts, "the source", surgery.device),
                      perplexities(result, texts, "the result", surgery.device))
    if job.recipe.eval.long_context:
        checks = [long_context_of(model, surgery.tokenizer, job, label, surgery.device)
                  for model, label in ((surgery.model, "the source"), (result, "the result"))]
        report.long_context = None if None in checks else tuple(checks)
    to_source_dtype(result, anatomy)
    report.seconds = time.perf_counter() - surgery.started
    report.peak_memory_gb = peak_memory_gb()
    files = {RECIPE_FILE: dump_recipe(recipe), **(extra_files or {})}
    info = card()
    info.license = info.license or source_license(job.recipe.model.ref)
    info.remote_code = bool(getattr(result.config, "auto_map", None))
    if note := source_note(job.recipe.model.ref):
        info.details.insert(0, note)
    info.figures[:0] = parameter_rows(surgery.model, result, surgery.family.attention_attr)
    add_score_rows(info, job, report)
    if report.heal is not None:
        add_healing(info, report.heal, recipe.heal, report.ppl_before)
    report.written = str(write_checkpoint(result, surgery.tokenizer, job.recipe.output, info, job.overwrite, extra_files=files,
                                           reads=job.reads))
    if recipe.heal is not None:
        remove_heal_state(heal_state_dir(job.recipe.output))
