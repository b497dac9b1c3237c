"""Runs under ``accelerate launch``: which process is the main one, and the surgery's result computed once and
shared with the others (and with a restarted heal run)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from attnsurg.heal import heal_state_dir, process_state
from attnsurg.io.load import resolve_device
from attnsurg.modeling import register as register_attnsurg
from attnsurg.io.recipe_file import RECIPE_FILE, dump_recipe
from attnsurg.errors import UserError
from attnsurg.pipelines.job import Job


def is_main_process() -> bool:
    return process_state().is_main_process


OPERATED_DIR = "operated"  # inside the heal state directory: the surgery's result, kept until healing is written


OPERATED_DONE, OPERATED_FAILED = "operated.done", "operated.failed"


WAIT_POLL_SECONDS = 2.0


def operated_once(write: Callable[[Path], None], job: Job) -> PreTrainedModel:
    """The surgery's result before healing, computed once per run: ``write(directory)`` writes it (float32)
    into the heal state beside the output (``OUT.heal-state/operated``), with the recipe step that made it, and
    it is loaded from there. A heal run started again loads it instead of operating again (a GPU's refinement is
    not bit-reproducible, and healing resumes only from the same starting weights), and under ``accelerate
    launch`` only the main process operates while the others wait for its marker file (not a collective
    barrier, which times out within a long surgery)."""
    state = process_state(resolve_device(job.device))
    recipe = job.recipe
    shared = heal_state_dir(job.recipe.output) / OPERATED_DIR
    made_by = dump_recipe(recipe.model_copy(update={"steps": recipe.steps[:1]}))
    if state.is_main_process:
        model = saved_operated(shared, made_by)
        if model is None:
            shutil.rmtree(shared, ignore_errors=True)  # a half-saved model, or another step's: never matches
            try:
                write(shared)
                (shared / RECIPE_FILE).write_text(made_by, encoding="utf-8")
            except BaseException:
                shared.mkdir(parents=True, exist_ok=True)
                (shared / OPERATED_FAILED).touch()
                raise
            model = saved_operated(shared, made_by)
        (shared / OPERATED_DONE).touch()
        state.wait_for_everyone()
        return model
    while (model := saved_operated(shared, made_by, require_done=True)) is None:
        if (shared / OPERATED_FAILED).exists():
            raise UserError("the main process's surgery failed (its message says why); nothing was healed")
        time.sleep(WAIT_POLL_SECONDS)
    state.wait_for_everyone()
    return model


def saved_operated(shared: Path, made_by: str, require_done: bool = False) -> PreTrainedModel | None:
    """The operated model saved by this run (an earlier start of it, or the main process), if the same recipe
    step made it (and, with ``require_done``, the main process has marked it complete for this start)."""
    recipe_file = shared / RECIPE_FILE
    if require_done and not (shared / OPERATED_DONE).exists():
        return None
    if not recipe_file.is_file() or recipe_file.read_text(encoding="utf-8") != made_by:
        return None
    register_attnsurg()
    return AutoModelForCausalLM.from_pretrained(shared, dtype=torch.float32).eval()
