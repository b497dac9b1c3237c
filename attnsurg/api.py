"""attnsurg from Python: the commands as functions.

Each function builds the recipe or request its command builds, with the command's defaults, runs it and returns
the command's report::

    import attnsurg

    report = attnsurg.convert("smollm2-135m", "out/mla50", to="mla", kv_budget=0.5)
    report = attnsurg.compress("smollm2-135m", "out/svdllm", method="svdllm", ratio=0.6)
    scores = attnsurg.evaluate(["smollm2-135m", "out/mla50"], data={"dataset": "c4-sample"})

Keyword arguments beyond the run's own are the method's settings, named as in a recipe (``MLASettings``;
``methods.lowrank.LowRankSettings``, ``methods.headtensor.HeadTensorSettings``, ...); a wrong name or value
raises pydantic's ``ValidationError`` naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from attnsurg.errors import UserError
from attnsurg.recipe import (
    CompressStep,
    ConvertStep,
    HealSettings,
    HealStep,
    Recipe,
)
from attnsurg.requests import (
    EVAL_DOMAINS,
    Calibration,
    ModelRef,
    PerplexityEval,
    SpeedEval,
    TasksEval,
)


def surgery_recipe(model: str | ModelRef, output: str | Path, step, calibration: Calibration | dict | None,
                   heal: HealSettings | dict | None, eval_tokens: int, eval_domains: list[str] | tuple[str, ...],
                   seed: int, eval_long: int = 0) -> Recipe:
    """The recipe a ``convert`` or ``compress`` command builds from its options."""
    steps = [step] + ([HealStep(heal=heal)] if heal is not None else [])
    from attnsurg.methods.base import method_for

    default = method_for(step.convert if isinstance(step, ConvertStep) else step.compress).calibration
    return Recipe(model=model, output=Path(output), steps=steps, calibration=calibration or default,
                  eval={"tokens": eval_tokens, "domains": list(eval_domains), "long_context": eval_long}, seed=seed)


def run(recipe: Recipe | str | Path, overwrite: bool = False, device: str = "auto", dry_run: bool = False):
    """``attnsurg run RECIPE``: a recipe object, a YAML file or a shipped recipe's name."""
    from attnsurg.io.recipe_file import load_recipe
    from attnsurg.pipelines.run import run_recipe

    return run_recipe(recipe if isinstance(recipe, Recipe) else load_recipe(recipe), dry_run, overwrite, device)


def convert(model: str, output: str | Path, *, to: str = "mla", calibration: Calibration | dict | None = None,
            heal: HealSettings | dict | None = None, eval_tokens: int = 2048,
            eval_domains: list[str] | tuple[str, ...] = EVAL_DOMAINS, eval_long: int = 0, seed: int = 0,
            overwrite: bool = False, device: str = "auto", dry_run: bool = False, **settings):
    """``attnsurg convert MODEL --to mla`` (or ``linear``); ``settings`` are the target's settings fields
    (``MLASettings``: ``kv_budget=0.5``, ``format="exact"``, ...; ``LinearSettings``: ``window=128``, ...).
    Returns the method's report (``ConvertReport``, ``LinearReport``)."""
    from attnsurg.methods.base import convert_target_names, settings_for_target

    if (target := settings_for_target(to)) is None:
        raise UserError(f"to={to!r} is not supported; available: {', '.join(convert_target_names())}")
    step = ConvertStep(convert=target(to=to, **settings))
    recipe = surgery_recipe(model, output, step, calibration, heal, eval_tokens, eval_domains, seed, eval_long)
    return run(recipe, overwrite, device, dry_run)


def compress(model: str, output: str | Path, *, method: str, calibration: Calibration | dict | None = None,
             heal: HealSettings | dict | None = None, eval_tokens: int = 2048,
             eval_domains: list[str] | tuple[str, ...] = EVAL_DOMAINS, eval_long: int = 0, seed: int = 0,
             overwrite: bool = False, device: str = "auto", dry_run: bool = False, **settings):
    """``attnsurg compress MODEL --method M``; ``settings`` are the method's settings fields (``ratio=0.5``,
    ``targets=("k", "v")``, ``kv_latent=True``, ``top_k=64``, ...). Returns the ``CompressReport``."""
    step = CompressStep(compress={"method": method, **settings})
    recipe = surgery_recipe(model, output, step, calibration, heal, eval_tokens, eval_domains, seed, eval_long)
    return run(recipe, overwrite, device, dry_run)


def evaluate(models: list[str] | str, what: Literal["perplexity", "tasks", "speed"] = "perplexity", **options):
    """``attnsurg eval perplexity|tasks|speed MODEL...``: every model on the same windows, items or contexts;
    ``options`` are the request's fields (``PerplexityEval``, ``TasksEval``, ``SpeedEval``). Returns its report."""
    refs = [models] if isinstance(models, str) else list(models)
    if what == "perplexity":
        from attnsurg.eval.perplexity import run_perplexity

        return run_perplexity(PerplexityEval(models=refs, **options))
    if what == "tasks":
        from attnsurg.eval.tasks import run_tasks

        return run_tasks(TasksEval(models=refs, **options))
    if what == "speed":
        from attnsurg.eval.speed import run_speed

        return run_speed(SpeedEval(models=refs, **options))
    raise UserError(f"what={what!r}: choose perplexity, tasks or speed")
