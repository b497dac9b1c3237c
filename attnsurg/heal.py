"""Healing: distil the original model (teacher) into the operated one (student) with accelerate.

The loss (``distillation.py``) is KL to the teacher's distribution, optionally with the next-token loss and a
residual-stream match, computed from both models' final hidden states a chunk of tokens at a time, so no
``[batch, seq, vocab]`` logits are ever formed. By default only the attention modules train, less the
values a conversion holds fixed for exactness (the MLA latent-norm channel and query route, Loki's PCA
basis). The same code runs on the CPU, on one GPU in bf16 and under ``accelerate launch`` on several.

Batches are a pure function of (seed, step), so a run that resumes from its saved state (accelerate's
``save_state``/``load_state``, every ``save_every`` steps and at the end) reaches the same weights as one
that never stopped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from transformers import PreTrainedModel

from attnsurg import ui
from attnsurg.adapters import add_lora, merge_lora
from attnsurg.data import load_text
from attnsurg.distillation import Head, LossWeights, logit_loss, residual_stream_error
from attnsurg.errors import UserError
from attnsurg.eval.perplexity import perplexity_of, scoring_windows
from attnsurg.io.save import refused_writes
from attnsurg.methods.mla.refine import hold_norm_channel, norm_channel_of
from attnsurg.recipe import HealSettings
from attnsurg.requests import TextData

STATE_MARKER = "heal.json"


@dataclass
class HealReport:
    steps: int
    tokens_per_step: int
    trainable_parameters: int
    resumed_from: int = 0
    seconds: float = 0.0
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean loss of the step)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out ppl)
    ppl_start: float | None = None  # after surgery, before healing, on the command's evaluation windows

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def tokens_per_second(self) -> float:
        trained = (self.steps - self.resumed_from) * self.tokens_per_step
        return trained / self.seconds if self.seconds else 0.0


def heal_state_dir(output: Path) -> Path:
    """Where a heal run keeps its resumable state: beside the output, never inside it."""
    output = Path(output)
    return output.parent / f"{output.name}.heal-state"


# ------------------------------------------------------------------------------------ what trains
def select_trainable(model: PreTrainedModel, train: str) -> list[torch.nn.Parameter]:
    """Mark what trains (attention modules, a linear conversion's feature maps, or everything) and return those
    parameters. ``lora`` marks what ``attention`` does; ``add_lora`` then moves the projections' training into
    adapters."""
    for parameter in model.parameters():
        parameter.requires_grad_(train == "all")
    if train == "features":
        return linear_feature_parameters(model)
    if train in ("attention", "lora"):
        for name, module in model.named_modules():
            if name.endswith(".self_attn"):
                module.requires_grad_(True)
    hold_exactness_constants(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise UserError("the student has no attention modules named '*.self_attn' to train; use train: all (--train all)")
    return trainable


def linear_feature_parameters(model: PreTrainedModel) -> list[torch.nn.Parameter]:
    """``train: features``: only what a linear conversion added (its feature maps, the linear part's weight and
    decay), so the window's softmax attention stays the source's."""
    added = [p for module in model.modules() if callable(getattr(module, "added_parameters", None))
             for p in module.added_parameters()]
    if not added:
        raise UserError("--train features trains a linear conversion's feature maps and this student has none; "
                        "use --train attention")
    for parameter in added:
        parameter.requires_grad_(True)
    return added


def hold_exactness_constants(model: PreTrainedModel) -> None:
    """Values a surgery fixed on purpose stay fixed: an MLA conversion's latent-norm channel and query route,
    and Loki's orthonormal key basis (training it would break the top-k scores' meaning)."""
    for name, module in model.named_modules():
        if hasattr(module, "kv_a_proj_with_mqa"):
            channel = norm_channel_of(module)
            if channel is not None:
                hold_norm_channel(module, channel)
        if hasattr(module, "loki_basis"):
            module.loki_basis.requires_grad_(False)


def held_projection_rows(model: PreTrainedModel) -> dict[str, int]:
    """Projection rows a LoRA adapter must leave alone: an MLA conversion's latent-norm channel in kv_a."""
    return {f"{name}.kv_a_proj_with_mqa": channel for name, module in model.named_modules()
            if hasattr(module, "kv_a_proj_with_mqa") and (channel := norm_channel_of(module)) is not None}


def lora_alpha(settings: HealSettings) -> float:
    return settings.lora_alpha if settings.lora_alpha is not None else 2.0 * settings.lora_rank


# ---------------------------------------------------------------------------------------- data
def training_windows(tokenizer, data: TextData, seq_len: int) -> torch.Tensor:
    """Disjoint ``[n, seq_len]`` windows over the whole training text (the calibration part of a dataset).
    Several datasets (a comma list, or ``all``) take turns window by window while each has windows left."""
    if len(names := data.datasets()) > 1:
        per_dataset = [training_windows(tokenizer, TextData(dataset=name, part=data.part), seq_len) for name in names]
        return torch.stack([windows[j] for j in range(max(map(len, per_dataset))) for windows in per_dataset
                            if j < len(windows)])
    text = load_text(data.dataset, data.text, data.part)
    ids = tokenizer(text.text, add_special_tokens=False)["input_ids"]
    n = len(ids) // seq_len
    if n == 0:
        raise UserError(f"training text '{text.name}' has {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


@functools.lru_cache(maxsize=4)
def window_order(n: int, epoch: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator)


def batch_indices(n: int, position: int, size: int, seed: int) -> list[int]:
    """Windows ``position .. position + size - 1`` of an endless stream of seeded epoch permutations."""
    out = []
    for p in range(position, position + size):
        epoch, offset = divmod(p, n)
        out.append(int(window_order(n, epoch, seed)[offset]))
    return out


# ---------------------------------------------------------------------------------------- loss
class Distiller:
    """Both models' forward passes and the loss between them.

    The student runs through its (possibly distributed) wrapper with logits for one position only; a hook
    keeps its decoder's final hidden state, to which the loss applies the output head a chunk at a time.
    The teacher runs its decoder alone, without gradients."""

    def __init__(self, wrapped: torch.nn.Module, student: PreTrainedModel, teacher: PreTrainedModel, settings: HealSettings):
        self.wrapped, self.teacher = wrapped, teacher
        self.weights = LossWeights(settings.kl_weight, settings.lm_weight, settings.hidden_weight, settings.temperature)
        self.student_head = Head.of(student.get_output_embeddings())
        self.teacher_head = Head.of(teacher.get_output_embeddings())
        self.final_hidden: torch.Tensor | None = None
        self.hook = student.get_decoder().register_forward_hook(self.keep_final_hidden)

    def keep_final_hidden(self, module, args, output) -> None:
        self.final_hidden = output.last_hidden_state

    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        layers = self.weights.hidden > 0
        with torch.no_grad():
            taught = self.teacher.get_decoder()(input_ids=input_ids, output_hidden_states=layers)
        learned = self.wrapped(input_ids=input_ids, output_hidden_states=layers, logits_to_keep=1)
        final, self.final_hidden = self.final_hidden, None
        loss = final.new_zeros((), dtype=torch.float32)
        if self.weights.kl or self.weights.lm:
            loss = logit_loss(final, self.student_head, taught.last_hidden_state, self.teacher_head, input_ids, self.weights)
        if layers:
            loss = loss + self.weights.hidden * residual_stream_error(learned.hidden_states, taught.hidden_states)
        return loss

    def close(self) -> None:
        self.hook.remove()


# ------------------------------------------------------------------------------ learning rate
def lr_factor(step: int, steps: int, warmup: int, schedule: str) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based): linear warmup that is
    already non-zero at the first step, then cosine, linear or constant to the last step."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress


# ------------------------------------------------------------------------------ resumable state
def weights_digest(parameters: list[torch.nn.Parameter]) -> str:
    digest = hashlib.sha256()
    for p in parameters:
        digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def fingerprint(settings: HealSettings, seed: int, processes: int, precision: str, start_weights: str) -> str:
    """Identifies a run: its settings (less how often it saves and scores), seed, process count, precision
    and the student's starting weights. Resuming anything else would mix two runs."""
    kept = settings.model_dump(mode="json", exclude={"save_every", "eval_every", "eval_tokens"})
    record = json.dumps([kept, seed, processes, precision, start_weights], sort_keys=True)
    return hashlib.sha256(record.encode()).hexdigest()[:16]


def saved_steps(state_dir: Path) -> list[tuple[int, Path, dict]]:
    """Complete saved states (the marker is written last), oldest first."""
    found = []
    for marker in state_dir.glob(f"step-*/{STATE_MARKER}"):
        record = json.loads(marker.read_text())
        found.append((record["step"], marker.parent, record))
    return sorted(found, key=lambda entry: entry[0])


def resume_step(accelerator: Accelerator, state_dir: Path, run_id: str, scheduler) -> int:
    states = saved_steps(state_dir) if state_dir.is_dir() else []
    if not states:
        return 0
    step, path, record = states[-1]
    if record["fingerprint"] != run_id:
        raise UserError(
            f"'{state_dir}' holds the state of a heal run with other settings or another student; "
            "rerun with the same settings to resume, or delete that directory to start over"
        )
    accelerator.load_state(str(path))  # safetensors weights and a weights-only optimizer load
    scheduler.load_state_dict(record["scheduler"])  # kept as JSON: nothing here is unpickled
    info(accelerator, f"resuming healing from step {step} ({path})")
    return step


def fitted_to_context(settings: HealSettings, max_positions: int | None) -> HealSettings:
    """Training windows that fit the student's context (past it, positions it never saw would be trained): a
    ``seq_len`` given past it is refused, the default one is cut to it."""
    if not max_positions or settings.seq_len <= max_positions:
        return settings
    if "seq_len" in settings.model_fields_set:
        raise UserError(f"--seq-len {settings.seq_len} is past the model's context of {max_positions} positions; "
                        f"use --seq-len {max_positions} or less")
    return settings.model_copy(update={"seq_len": max_positions})


def forget_saved_steps(state_dir: Path) -> None:
    """A run that cannot go on (it diverged) leaves no step to resume into the same failure."""
    for _, path, _ in saved_steps(state_dir) if state_dir.is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)


def save_step(accelerator: Accelerator, state_dir: Path, step: int, run_id: str, scheduler) -> None:
    path = state_dir / f"step-{step:08d}"
    with refused_writes(state_dir, "the last complete step is kept to resume from"):
        accelerator.save_state(str(path))
    accelerator.wait_for_everyone()  # every process has written its part before the marker says complete
    if accelerator.is_main_process:
        record = {"step": step, "fingerprint": run_id, "scheduler": scheduler.state_dict()}
        (path / STATE_MARKER).write_text(json.dumps(record))
        for _, older, _ in saved_steps(state_dir)[:-1]:
            shutil.rmtree(older, ignore_errors=True)
    accelerator.wait_for_everyone()


def remove_heal_state(state_dir: Path) -> None:
    """Called once the healed checkpoint is written: until then an interrupted run can resume."""
    if process_state().is_main_process:
        shutil.rmtree(state_dir, ignore_errors=True)


def info(accelerator: Accelerator, message: str) -> None:
    if accelerator.is_main_process:
        ui.info(message)


# ------------------------------------------------------------------------------------ training
def runs_on_cpu(device: torch.device | None = None) -> bool:
    """No GPU, ``--device cpu``, or ``accelerate launch --cpu``."""
    forced = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return forced or not torch.cuda.is_available() or (device is not None and device.type == "cpu")


def process_state(device: torch.device | None = None) -> PartialState:
    """This process's place among those ``accelerate launch`` (torchrun) started. accelerate keeps one state
    per process, fixed by whoever creates it first; created here as healing's Accelerator creates it (on the
    CPU where there is no GPU), so CPU processes form one group whichever asks first. A single process asked
    for ``cuda:N`` makes that GPU its current device first, so accelerate trains there."""
    if device is not None and device.type == "cuda" and device.index is not None and "LOCAL_RANK" not in os.environ:
        torch.cuda.set_device(device)
    return PartialState(cpu=runs_on_cpu(device))


def make_accelerator(settings: HealSettings, device: torch.device | None = None) -> Accelerator:
    """bf16 mixed precision on a GPU that has it (``auto``); on the CPU when asked (``device`` cpu) or when
    there is no GPU. Under ``accelerate launch`` each process takes the GPU accelerate gives it."""
    on_cpu = runs_on_cpu(device)
    process_state(device)
    precision = settings.mixed_precision
    if precision == "auto":
        precision = "bf16" if not on_cpu and torch.cuda.is_bf16_supported() else "no"
    # cpu=True where there is no GPU: that is what lets torchrun / mpirun processes form a multi-CPU group
    return Accelerator(mixed_precision=precision, cpu=on_cpu)


def heal_model(
    student: PreTrainedModel,
    teacher: PreTrainedModel,
    tokenizer,
    settings: HealSettings,
    seed: int,
    state_dir: Path,
    on_step: Callable[[int], None] | None = None,
    device: torch.device | None = None,
) -> HealReport:
    """Train ``student`` in place toward ``teacher``; returns what happened. State is saved in ``state_dir``
    every ``save_every`` steps and at the end; started again with the same arguments, it resumes there.
    The caller removes it (``remove_heal_state``) once the result is safely written."""
    accelerator = make_accelerator(settings, device)
    windows = training_windows(tokenizer, settings.data, settings.seq_len)
    held_out = held_out_windows(tokenizer, settings) if settings.eval_every else None
    trainable = select_trainable(student, settings.train)
    start_weights = weights_digest(trainable)
    torch.manual_seed(seed)
    if settings.train == "lora":
        trainable = add_lora(student, settings.lora_rank, lora_alpha(settings), held_projection_rows(student))
    if settings.gradient_checkpointing:
        activation_checkpointing(student, True)
    micro_batch = settings.batch_size * accelerator.num_processes
    tokens_per_step = settings.seq_len * micro_batch * settings.grad_accum
    steps = max(1, settings.tokens // tokens_per_step)
    report = HealReport(steps, tokens_per_step, sum(p.numel() for p in trainable))
    run_id = fingerprint(settings, seed, accelerator.num_processes, accelerator.mixed_precision, start_weights)

    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = min(math.ceil(settings.warmup * steps), steps - 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i, steps, warmup, settings.schedule))
    wrapped, optimizer = accelerator.prepare(student, optimizer)
    teacher.to(accelerator.device).eval().requires_grad_(False)
    distiller = Distiller(wrapped, student, teacher, settings)
    report.resumed_from = start = resume_step(accelerator, state_dir, run_id, scheduler)

    started = time.perf_counter()
    wrapped.train()
    bar = ui.progress_bar("Healing", total=steps, unit="steps") if accelerator.is_main_process else nullcontext(lambda *a, **k: None)
    with bar as advance:
        advance(start)
        for step in range(start, steps):
            loss = train_step(accelerator, distiller, optimizer, scheduler, windows, settings, seed, step, trainable)
            if not math.isfinite(loss):
                forget_saved_steps(state_dir)
                raise UserError(f"healing diverged: the distillation loss became {loss} at step {step + 1}; lower "
                                f"--lr (it is {settings.lr:g}) or raise --warmup (nothing was written)")
            report.losses.append((step + 1, loss))
            rate = (step + 1 - start) * tokens_per_step / (time.perf_counter() - started)
            advance(1, note=f"loss {loss:.4f}, {rate:,.0f} tok/s")
            if held_out is not None and (step + 1) % settings.eval_every == 0:
                report.evals.append((step + 1, evaluate(accelerator, wrapped, held_out)))
                info(accelerator, f"step {step + 1}/{steps}: loss {loss:.4f}, held-out ppl {report.evals[-1][1]:.3f}")
            if (step + 1) % settings.save_every == 0 or step + 1 == steps:
                save_step(accelerator, state_dir, step + 1, run_id, scheduler)
            if on_step is not None:
                on_step(step + 1)
    report.seconds = time.perf_counter() - started
    accelerator.wait_for_everyone()
    distiller.close()
    student = accelerator.unwrap_model(wrapped, keep_fp32_wrapper=False).eval()
    merge_lora(student)
    student.requires_grad_(False)
    if settings.gradient_checkpointing:
        activation_checkpointing(student, False)
    accelerator.free_memory()
    return report


def activation_checkpointing(model: PreTrainedModel, on: bool) -> None:
    """Recompute each layer's activations in the backward pass (on) or keep them (off); transformers names it
    activation checkpointing from 5.x on, gradient checkpointing before."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def train_step(accelerator, distiller: Distiller, optimizer, scheduler, windows, settings, seed, step, trainable) -> float:
    """One optimizer step over ``grad_accum`` micro-batches; returns the step's mean loss."""
    total = torch.zeros((), device=accelerator.device)
    for micro in range(settings.grad_accum):
        position = ((step * settings.grad_accum + micro) * accelerator.num_processes + accelerator.process_index)
        rows = batch_indices(len(windows), position * settings.batch_size, settings.batch_size, seed)
        input_ids = windows[rows].to(accelerator.device)
        with accelerator.autocast():
            loss = distiller.loss(input_ids) / settings.grad_accum
        last = micro == settings.grad_accum - 1
        with nullcontext() if last else accelerator.no_sync(distiller.wrapped):
            accelerator.backward(loss)
        total += loss.detach()
    accelerator.clip_grad_norm_(trainable, settings.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return accelerator.reduce(total, reduction="mean").item()  # the step's loss over every process


def held_out_windows(tokenizer, settings: HealSettings):
    """Scored during training: the start of the training dataset's eval part (a user's file: its start,
    which the training text includes)."""

    return scoring_windows(tokenizer, settings.data, settings.eval_tokens, None)


def evaluate(accelerator: Accelerator, student, held_out) -> float:
    model = accelerator.unwrap_model(student)
    model.eval()
    with accelerator.autocast():
        ppl = perplexity_of(model, *held_out, "the student")
    model.train()
    return ppl
