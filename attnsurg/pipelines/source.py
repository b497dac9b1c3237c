"""Starting a surgery: the source loaded (whole, or read a layer at a time), its calibration windows and the
device the work runs on."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel, set_seed

from attnsurg import ui
from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import Family, family_for_surgery
from attnsurg.arch.unfuse import UNFUSED_AS, UnfusedReader, unfused_config, unfused_model
from attnsurg.calibrate import calibration_windows
from attnsurg.data import read_text_file
from attnsurg.io.lazy import CheckpointReader
from attnsurg.io.load import DTYPES, load_config, load_model, load_tokenizer, resolve_device
from attnsurg.io.guard import check_output_path
from attnsurg.errors import UserError
from attnsurg.pipelines.job import Job
from attnsurg.requests import Calibration, ModelRef
from attnsurg.pipelines.scoring import domain_texts, fetch_domains


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


def to_source_dtype(model: PreTrainedModel, anatomy: AttentionAnatomy) -> PreTrainedModel:
    """Fitted in float64, evaluated in float32, saved in the source's dtype."""
    model.to(DTYPES.get(anatomy.dtype, torch.float32))
    model.config.dtype = anatomy.dtype
    return model


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
