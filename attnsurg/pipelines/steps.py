"""Steps every surgery command shares: load the source, calibration windows, ppl before/after, timing."""

from __future__ import annotations

import resource
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel, set_seed

from attnsurg import ui
from attnsurg.arch.anatomy import AttentionAnatomy, meta_model
from attnsurg.arch.families import Family, family_for_surgery
from attnsurg.arch.unfuse import UNFUSED_AS, UnfusedReader, unfused_config, unfused_model
from attnsurg.calibrate import calibration_windows
from attnsurg.data import read_text_file
from attnsurg.eval.perplexity import Tokens, perplexity_of, scoring_windows
from attnsurg.eval.windows import Window
from attnsurg.heal import heal_model, heal_state_dir, process_state, remove_heal_state
from attnsurg.io.card import CardInfo
from attnsurg.io.lazy import OFFLOADED, CheckpointReader, scoring_model
from attnsurg.io.load import DTYPES, load_config, load_model, load_tokenizer, resolve_device
from attnsurg.io.guard import check_output_path
from attnsurg.io.save import finish_staging, write_checkpoint
from attnsurg.modeling import register as register_attnsurg
from attnsurg.io.recipe_file import RECIPE_FILE, dump_recipe
from attnsurg.errors import UserError
from attnsurg.pipelines.job import Job
from attnsurg.requests import Calibration, ModelRef, TextData


def command_line() -> str | None:
    """The attnsurg command this process runs, or None where attnsurg runs as a library (a script's own
    arguments are not an attnsurg command; the card's recipe says how the checkpoint was made)."""
    program = Path(sys.argv[0])
    if program.name != "attnsurg" and program.parts[-2:] != ("attnsurg", "__main__.py"):
        return None
    return "attnsurg " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def peak_memory_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def load_source(ref: ModelRef, source) -> tuple[PreTrainedModel, object]:
    """The source model in float32 on the CPU (decompositions run in float64 from it) and its tokenizer."""
    return load_source_model(ref, source), load_tokenizer(source, ref.trust_remote_code)


def load_source_model(ref: ModelRef, source) -> PreTrainedModel:
    """The source model alone, float32 on the CPU, its weights checked whole and finite (``load_model``)."""
    with ui.status(f"Loading {ref.ref}..."):
        return unfused_model(load_model(source, torch.float32, "cpu", ref.trust_remote_code, ref.allow_pickle))


def window_length(calibration: Calibration, anatomy: AttentionAnatomy) -> int:
    """Calibration windows are cut at --calib-seq-len, or at the model's context when that is shorter."""
    return min(calibration.seq_len, anatomy.max_positions or calibration.seq_len)


def check_calibration(calibration: Calibration, anatomy: AttentionAnatomy, read_text: bool = True) -> None:
    """What can be checked about the calibration request before any weights load: one window fits in the
    tokens read, and (``read_text``: a dry run, which cuts no windows) a text file is text."""
    seq_len = window_length(calibration, anatomy)
    if seq_len > calibration.tokens:
        capped = f" (capped at the model's context, {seq_len})" if seq_len < calibration.seq_len else ""
        raise UserError(f"calibration seq_len (--calib-seq-len) {calibration.seq_len}{capped} is longer than its tokens "
                        f"(--calib-tokens) {calibration.tokens}, which windows are cut from; lower it or read more tokens")
    if read_text and calibration.data.text is not None:
        read_text_file(Path(calibration.data.text))


def source_windows(tokenizer, calibration: Calibration, anatomy: AttentionAnatomy) -> torch.Tensor:
    return calibration_windows(tokenizer, calibration.data, calibration.tokens, window_length(calibration, anatomy))


def scored_text(calibration: TextData) -> TextData:
    """The text whose eval part is scored first, as "the calibration text": the calibration text itself, or the
    first of several calibration datasets."""
    return calibration.scored()


def domain_texts(calibration: TextData, domains: list[str], eval_tokens: int) -> list[TextData]:
    """The evaluation domains scored besides the calibration text (its own domain is not repeated)."""
    first = scored_text(calibration).dataset
    return [TextData(dataset=d) for d in domains if d != first] if eval_tokens else []


def fetch_domains(texts: list[TextData]) -> None:
    """Fetch the domains' texts before any heavy work, so a missing one fails in seconds."""
    from attnsurg.io.assets import ensure_text

    for data in texts:
        try:
            ensure_text(data.dataset)
        except UserError as exc:
            raise UserError(f"{exc} (evaluation domain {data.dataset}; --eval-domains none, or in a recipe "
                            "eval: {domains: []}, skips them)") from None


def score_domains(source: PreTrainedModel, result: PreTrainedModel, tokenizer, texts: list[TextData], eval_tokens: int,
                  max_positions: int | None, device: torch.device | None = None) -> dict[str, tuple[float, float]]:
    """ppl of the source and of the result on the first ``eval_tokens`` of each domain's eval part."""
    scores = {}
    for data in texts:
        windows = scoring_windows(tokenizer, data, eval_tokens, max_positions)
        scores[data.dataset] = (perplexity_of(source, *windows, f"the source on {data.dataset}", device),
                                perplexity_of(result, *windows, f"the result on {data.dataset}", device))
    return scores


def worst_domain(scores: dict[str, tuple[float, float]]) -> str | None:
    return max(scores, key=lambda d: scores[d][1] / scores[d][0]) if scores else None


def domain_rows(scores: dict[str, tuple[float, float]], eval_tokens: int, before: str = "") -> list[dict[str, str]]:
    """The card's rows for the domains, the worst ratio named in its row (``before``: what the first
    figure is, when not the source model)."""
    worst = worst_domain(scores)
    of = f" of the {before}" if before else ""
    return [perplexity_row(TextData(dataset=d), eval_tokens, first, after,
                           f" (x{after / first:.3f}{of}{', the worst domain' if d == worst and len(scores) > 1 else ''})")
            for d, (first, after) in scores.items()]


def to_source_dtype(model: PreTrainedModel, anatomy: AttentionAnatomy) -> PreTrainedModel:
    """Fitted in float64, evaluated in float32, saved in the source's dtype."""
    model.to(DTYPES.get(anatomy.dtype, torch.float32))
    model.config.dtype = anatomy.dtype
    return model


def base_model_id(ref: str) -> str | None:
    """The hub id for the card's ``base_model``: a built-in model's home, a hub id, or what a local source's
    own card names."""
    from attnsurg.io.assets import ASSETS

    if ref in ASSETS:
        return ASSETS[ref].hub_id
    if "/" in ref and not ref.startswith((".", "/", "~")) and not Path(ref).exists():
        return ref
    return source_card_data(ref).get("base_model")


def source_card_data(ref: str) -> dict:
    """The metadata of a local source's own model card (README.md front matter), if it has one."""
    from huggingface_hub import ModelCard

    card = Path(ref).expanduser() / "README.md"
    try:
        return ModelCard.load(card).data.to_dict() if card.is_file() else {}
    except Exception:  # noqa: BLE001 - a card we cannot parse is a card without metadata
        return {}


def source_license(ref: str) -> str | None:
    from attnsurg.io.assets import ASSETS

    return ASSETS[ref].license if ref in ASSETS else source_card_data(ref).get("license")


def source_note(ref: str) -> str | None:
    """What a built-in source is, for the card: where its weights came from."""
    from attnsurg.io.assets import ASSETS

    if ref not in ASSETS:
        return None
    asset = ASSETS[ref]
    kind = "opt-in real model" if asset.opt_in else "demo model"
    return (f"Source: `{ref}`, attnsurg's built-in {kind}: {asset.description} "
            f"(`{asset.file_name()}` from the PyPI wheel{'s' if asset.more_chunks else ''} {asset.source()}).")


def parameter_rows(source: PreTrainedModel, result: PreTrainedModel, attention_attr: str) -> list[dict[str, str]]:
    """The card's parameter counts, attention and total, before and after."""
    def counts(model: PreTrainedModel) -> tuple[int, int]:
        params = dict(model.named_parameters())  # tied weights once
        attention = sum(p.numel() for name, p in params.items() if f".{attention_attr}." in name)
        return attention, sum(p.numel() for p in params.values())

    (attention_before, total_before), (attention_after, total_after) = counts(source), counts(result)
    return [{"metric": "attention parameters", "before": f"{attention_before:,}", "after": f"{attention_after:,}"},
            {"metric": "parameters in all", "before": f"{total_before:,}", "after": f"{total_after:,}"}]


GPU_HEADROOM_BYTES = 2 * 1024**3  # activations, the fit's transfers, the allocator's slack


def surgery_device(requested: str, anatomy: AttentionAnatomy) -> torch.device:
    """The device a loaded surgery runs on: the whole source moves there in float32, with every layer's
    float64 statistics (two (D+1)^2 moments per hooked module, up to two modules per layer). ``auto`` takes the
    GPU only when that fits its free memory, else the CPU; an explicit GPU that it does not fit is refused."""
    device = resolve_device(requested)
    if device.type != "cuda":
        return device
    moments = 2 * 2 * anatomy.num_layers * (anatomy.hidden_size + 1) ** 2 * 8
    needed = anatomy.total_parameters * 4 + moments + GPU_HEADROOM_BYTES
    free = torch.cuda.mem_get_info(device)[0]
    if needed <= free:
        return device
    if requested == "auto":
        ui.info(f"the source in float32 and its statistics need {needed / 1e9:.1f} GB, more than the GPU's "
                f"{free / 1e9:.1f} GB free: calibrating on the CPU (--stream runs one layer at a time on the GPU)")
        return torch.device("cpu")
    raise UserError(f"the source in float32 and its statistics need {needed / 1e9:.1f} GB, more than {device}'s "
                    f"{free / 1e9:.1f} GB free; use --stream (MLA: one layer on the GPU at a time) or --device cpu")


@dataclass
class Surgery:
    """A surgery under way: the source loaded in float32 on the CPU, its tokenizer, calibration windows and
    the device the work runs on."""

    family: Family
    model: PreTrainedModel | None  # None in a streamed surgery
    tokenizer: object
    windows: torch.Tensor
    started: float
    device: torch.device
    calibration: Calibration  # as read: its tokens those the windows hold (``calibration_read``)


def start_surgery(job: Job, source, anatomy: AttentionAnatomy, load_weights: bool = True) -> Surgery:
    """Refuse an existing output first (nothing is loaded for a request that cannot be written), seed, load
    the source (without ``load_weights``: its tokenizer only, for a streamed surgery) and cut the calibration
    windows."""
    check_output_path(job.recipe.output, job.overwrite, job.reads)
    device = surgery_device(job.device, anatomy) if load_weights else resolve_device(job.device)
    fetch_domains(domain_texts(job.recipe.calibration.data, job.recipe.eval.domains, job.recipe.eval.tokens))
    set_seed(job.recipe.seed)
    started = time.perf_counter()
    family = family_for_surgery(anatomy.model_type)
    tokenizer = load_tokenizer(source, job.recipe.model.trust_remote_code)
    windows = source_windows(tokenizer, job.recipe.calibration, anatomy)  # a text too short fails before the weights load
    model = load_source_model(job.recipe.model, source) if load_weights else None
    return Surgery(family, model, tokenizer, windows, started, device, calibration_read(job.recipe.calibration, windows))


def calibration_read(asked: Calibration, windows: torch.Tensor) -> Calibration:
    """The calibration as read: a text shorter than ``tokens`` gives fewer, which is said once and is what the
    card and the method are told."""
    read, length = windows.numel(), windows.shape[1]
    if read >= asked.tokens // length * length:  # whole windows, as asked
        return asked
    ui.warn(f"the calibration text gives {read:,} tokens in windows of {length}, fewer than the "
            f"{asked.tokens:,} asked (--calib-tokens); calibrating on those {read:,}")
    return asked.model_copy(update={"tokens": read})


def streams(asked: bool | None, refusal: str | None) -> bool:
    """Whether the run reads the source a layer at a time: as asked (``stream: true`` refused with the reason it
    cannot), or by default (``None``) whenever it can, so memory holds one layer of the source, not the whole model."""
    if asked and refusal:
        raise UserError(refusal)
    return refusal is None if asked is None else asked


LayerReader = CheckpointReader | UnfusedReader  # a source's tensors one at a time, as the family surgery operates on


def start_streamed(job: Job, source, anatomy: AttentionAnatomy) -> tuple[Surgery, PretrainedConfig, torch.dtype, LayerReader]:
    """A surgery that reads the source one decoder layer at a time (``streams``): its tokenizer and windows, the
    config of the family it operates on, the dtype the output is written in (the source's) and the reader of the
    source's tensors."""
    surgery = start_surgery(job, source, anatomy, load_weights=False)
    stored = load_config(source, job.recipe.model.trust_remote_code)
    reader = CheckpointReader(Path(source.path))
    if stored.model_type in UNFUSED_AS:  # read as the family it equals, each fused tensor split on read
        reader, config = UnfusedReader(reader, stored), unfused_config(stored)
    else:
        config = stored
    return surgery, config, DTYPES.get(str(config.dtype or "float32").removeprefix("torch."), torch.float32), reader


def generation_config(source_path: str, config) -> GenerationConfig:
    """The source's generation settings (eos and the like), or those its config implies."""
    try:
        return GenerationConfig.from_pretrained(source_path)
    except OSError:
        return GenerationConfig.from_model_config(config)


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
    if texts:
        scores = []
        for label, path in (("the source", Path(source.path)), ("the result", staging)):
            model = scoring_model(path, surgery.device)  # one model in memory at a time
            offloaded |= hasattr(model, OFFLOADED)
            scores.append(perplexities(model, texts, label))
            del model
        record_scores(report, texts, *scores)
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


ScoredText = tuple[str, Tokens, list[Window]]  # a text's name, its tokens and the windows scored


def scored_texts(tokenizer, job: Job, anatomy: AttentionAnatomy) -> list[ScoredText]:
    """The windows every before/after score uses: the calibration text's eval part first, then each domain's
    (none without eval tokens, or on a process that does not score)."""
    if not job.recipe.eval.tokens or not is_main_process():
        return []
    first = scored_text(job.recipe.calibration.data)
    texts = [first, *domain_texts(job.recipe.calibration.data, job.recipe.eval.domains, job.recipe.eval.tokens)]
    return [(data.dataset or str(data.text), *scoring_windows(tokenizer, data, job.recipe.eval.tokens, anatomy.max_positions))
            for data in texts]


def perplexities(model: PreTrainedModel, texts: list[ScoredText], label: str, device: torch.device | None = None) -> list[float]:
    """The model's token perplexity on each text (the first named ``label`` alone on the progress bar)."""
    return [perplexity_of(model, tokens, windows, label if i == 0 else f"{label} on {name}", device)
            for i, (name, tokens, windows) in enumerate(texts)]


def record_scores(report, texts: list[ScoredText], before: list[float], after: list[float]) -> None:
    report.ppl_before, report.ppl_after = before[0], after[0]
    report.domains = {name: (b, a) for (name, _, _), b, a in zip(texts[1:], before[1:], after[1:], strict=True)}


def add_score_rows(info: CardInfo, job: Job, report) -> None:
    """The card's perplexity rows: the calibration text's, then each domain's."""
    if report.ppl_before is None:
        return
    info.figures.append(perplexity_row(scored_text(job.recipe.calibration.data), job.recipe.eval.tokens, report.ppl_before,
                                       report.ppl_after, f" (x{report.ppl_after / report.ppl_before:.3f}, the calibration text)"))
    info.figures.extend(domain_rows(report.domains, job.recipe.eval.tokens))


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


def perplexity_row(data: TextData, eval_tokens: int, before: float, after: float, note: str = "") -> dict[str, str]:
    """The card's before/after perplexity row."""
    name = data.dataset or str(data.text)
    return {"metric": f"ppl, {name} eval part, first {eval_tokens} tokens{note}", "before": f"{before:.3f}", "after": f"{after:.3f}"}


def is_main_process() -> bool:
    return process_state().is_main_process


def healing_note(report) -> str:
    """The card's word on healing: "no healing", or what healing will be described below."""
    return "healed after the surgery (see below)" if getattr(report, "heal", None) is not None else "no healing"


def trained_part(settings) -> str:
    if settings.train == "lora":
        return f"LoRA adapters of rank {settings.lora_rank} on the attention, merged into the weights"
    return settings.train


def add_healing(info: CardInfo, heal, settings, ppl_original: float | None = None) -> None:
    data = settings.data.dataset or str(settings.data.text)
    teacher = settings.teacher.ref if settings.teacher else "the source model"
    info.details.append(
        f"healing: distillation from {teacher} (KL weight {settings.kl_weight}, LM weight {settings.lm_weight}, "
        f"T {settings.temperature}) on {heal.tokens:,} tokens of the {settings.data.part} part of {data}, "
        f"{heal.steps} steps of {heal.tokens_per_step} tokens, lr {settings.lr} ({settings.schedule}), training "
        f"{trained_part(settings)} ({heal.trainable_parameters:,} parameters), {heal.tokens_per_second:,.0f} tokens/s"
    )
    if heal.ppl_start is not None and ppl_original is not None:
        info.figures.append({"metric": "ppl after the surgery, before healing (same windows)",
                             "before": f"{ppl_original:.3f}", "after": f"{heal.ppl_start:.3f}"})
    if heal.losses:
        info.figures.append({"metric": "distillation loss (first step, last step)",
                             "before": f"{heal.losses[0][1]:.4f}", "after": f"{heal.losses[-1][1]:.4f}"})
