"""Layer-wise refinement (step 6 of the package docstring): Adam on each converted layer so its residual
update matches what brings the converted stream back to the original's."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from attnsurg.arch.families import Family
from attnsurg.calibrate import additive_mask, prompt_layout
from attnsurg.placement import on_device
from attnsurg.methods.mla.assemble import attention_state
from attnsurg.methods.mla.fit import MLAWeights


REFINE_STEP_TOKENS = 512  # tokens per refinement step: whole windows, at least one
REFINE_STEP_QUERIES = 128  # query positions scored per step; every key and value of the windows is kept
WINDOWS_PER_CHUNK = 8  # whole-window forwards over the refinement data run at most this many windows at a time,
CHUNK_BYTES = 1 << 28  # and fewer when their per-head activations would pass this (wide layers, many heads)
SCHEDULES = ("constant", "cosine")
COSINE_FLOOR = 0.1  # the cosine schedule decays the learning rate to this fraction of its peak
HELD_OUT_CHECK = 10  # refinement checks the held-out error every this many steps
HELD_OUT_PATIENCE = 2  # and stops after this many checks without a new lowest one
RATE_BACKOFF = 4  # refinement retries at lr / 4 when no step lowered the layer's error
RATE_RETRIES = 2  # and at most this many times (1e-3, 2.5e-4, 6.25e-5 by default)
HELD_OUT_SHARE = 0.25  # held-out windows per refinement window, when the calibration windows have them


class LayerError(NamedTuple):
    """A refined layer's relative output error: closed form (before) and kept weights (after), on the
    refinement windows and on the held-out windows refinement never trains on (None without them)."""

    before: float
    after: float
    held_before: float | None = None
    held_after: float | None = None
    steps: int = 0  # Adam steps of the kept weights (0: the closed form was kept)
    lr: float | None = None  # the learning rate of the kept steps (lower than asked after a backoff)
    start: int = 0  # the closed form refinement started from: its index among the layer's (``fit.closed_form_labels``)


# ---------------------------------------------------------------------------------- refinement
@dataclass(frozen=True)
class Refinement:
    """Layer-wise refinement settings: Adam steps per layer, calibration tokens read, peak learning rate and
    its schedule. Measured on the demo model at 25% KV: a constant rate suits short runs (40 steps over 2048
    tokens: x2.86, cosine x2.99); long runs need the decay (320 steps over 32768 tokens: x2.05, cosine x1.86)."""

    steps: int = 40
    tokens: int = 2048
    lr: float = 1e-3
    schedule: str = "constant"


def window_layout(windows: int, length: int, starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's position ``[n, L]`` and what it sees ``[n, L, L]``: plain causal windows, or the prompts
    that ``starts`` cuts them into (``calibrate.short_prompt_starts``)."""
    if starts is None:
        starts = torch.zeros(windows, length, dtype=torch.bool)
        starts[:, 0] = True
    return prompt_layout(starts)


def mla_attention(config: DeepseekV3Config, index: int, w: MLAWeights, o_weight: torch.Tensor) -> DeepseekV3Attention:
    """A float32 DeepseekV3 attention module holding one converted layer."""
    attention = DeepseekV3Attention(config, index)
    state = attention_state(w, o_weight, config.q_lora_rank is not None)
    attention.load_state_dict({k: v.detach().float() for k, v in state.items()})
    return attention


def norm_channel_of(attention: DeepseekV3Attention) -> int | None:
    """The latent row a conversion made constant (zero weights, non-zero bias), if any."""
    kv_a = attention.kv_a_proj_with_mqa
    if kv_a.bias is None:
        return None
    rank = attention.config.kv_lora_rank
    rows = torch.nonzero((kv_a.weight[:rank].abs().amax(dim=1) == 0) & (kv_a.bias[:rank] != 0)).flatten()
    return int(rows[-1]) if len(rows) else None


def hold_norm_channel(attention: DeepseekV3Attention, rank: int) -> None:
    """Keep the latent-norm channel (row ``rank`` of kv_a) at its constant and the query route fixed while
    the rest trains: the latent RMSNorm stays neutralised."""
    attention.kv_a_layernorm.weight.requires_grad_(False)
    if attention.q_a_proj is not None:  # the query route is fixed; q_b (weights and bias column) trains
        attention.q_a_proj.requires_grad_(False)
        attention.q_a_layernorm.requires_grad_(False)
    keep = torch.ones(attention.kv_a_proj_with_mqa.weight.shape[0], 1, device=attention.kv_a_proj_with_mqa.weight.device)
    keep[rank] = 0
    attention.kv_a_proj_with_mqa.weight.register_hook(lambda g: g * keep.to(device=g.device, dtype=g.dtype))
    attention.kv_a_proj_with_mqa.bias.register_hook(lambda g: g * keep[:, 0].to(device=g.device, dtype=g.dtype))


def refined_parameters(attention: DeepseekV3Attention) -> list[torch.nn.Parameter]:
    """Refinement's trainable parameters: everything but o_proj and, in the exact format, the norm channel."""
    channel = norm_channel_of(attention)
    if channel is not None:
        hold_norm_channel(attention, channel)
    attention.o_proj.requires_grad_(False)
    return [p for p in attention.parameters() if p.requires_grad]


def sampled_output(attention: DeepseekV3Attention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   rows: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """The attention output at query positions ``rows`` only, every key and value kept: the same computation
    as ``attention.forward`` (tested equal), at the cost of len(rows) queries instead of all. ``rope`` is
    per window or shared ([n or 1, L, dims]); ``visible`` ([n, L, L] bool) defaults to causal."""
    batch, length = x.shape[:2]
    config = attention.config
    if attention.q_a_proj is None:
        q = attention.q_proj(x[:, rows])
    else:
        q = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(x[:, rows])))
    q = q.view(batch, len(rows), -1, attention.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [attention.qk_nope_head_dim, attention.qk_rope_head_dim], dim=-1)
    latent, k_rot = torch.split(attention.kv_a_proj_with_mqa(x), [config.kv_lora_rank, attention.qk_rope_head_dim], dim=-1)
    latent = attention.kv_a_layernorm(latent).view(batch, 1, length, config.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, length, attention.qk_rope_head_dim)
    cos, sin = rope
    rotate = apply_rotary_pos_emb_interleave if config.rope_interleave else apply_rotary_pos_emb
    q_rot, _ = rotate(q_rot, q_rot[..., :1, :], cos[:, rows], sin[:, rows])
    _, k_rot = rotate(k_rot[..., :1, :], k_rot, cos, sin)
    keys, values = attention.expand_kv(latent, k_rot)
    visible = rows[:, None] >= torch.arange(length, device=rows.device)[None] if visible is None else visible[:, None, rows]
    output = torch.nn.functional.scaled_dot_product_attention(
        torch.cat([q_pass, q_rot], dim=-1), keys, values, attn_mask=visible, scale=attention.scaling
    )
    return attention.o_proj(output.transpose(1, 2).reshape(batch, len(rows), -1))


def windows_at_once(heads: int, length: int, per_position: int) -> int:
    """Windows per whole-window forward: up to WINDOWS_PER_CHUNK, as many as keep the float32 activations
    (``per_position`` values per head and position, plus the scores and probabilities) within CHUNK_BYTES."""
    per_window = 4 * heads * length * (per_position + 2 * length)
    return max(1, min(WINDOWS_PER_CHUNK, CHUNK_BYTES // per_window))


def refine_layer(
    w: MLAWeights, config: DeepseekV3Config, index: int, o_weight: torch.Tensor, x: torch.Tensor, target: torch.Tensor,
    settings: Refinement, token_scale: torch.Tensor | None = None, held_out: int = 0,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None, alternatives: Sequence[MLAWeights] = (),
) -> tuple[MLAWeights, LayerError, torch.Tensor]:
    """Adam on the converted layer so its output on the windows ``x`` matches ``target``; returns the kept
    weights, their errors (on REFINE_STEP_QUERIES fixed query rows of every window) and the layer's output on
    ``x`` with them. Refinement starts from whichever of ``w`` and the ``alternatives`` (other closed forms of
    the same layer) has the lowest error on the training windows.

    The last ``held_out`` windows are never trained on. With them, the held-out error is checked every
    HELD_OUT_CHECK steps: the weights with the lowest one are kept, and refinement stops once it has not
    fallen for HELD_OUT_PATIENCE checks (early stopping). Without them, the closed form is kept when
    refinement does not lower the training error. When no step lowers the error at ``settings.lr``, refinement
    starts again from the closed form at each lower ``backoff_rates`` in turn.

    Each step takes the next REFINE_STEP_TOKENS worth of training windows in turn and scores
    REFINE_STEP_QUERIES random query positions of them against all their keys and values. On the demo model
    40 steps of one 512-token window reached a lower layer error than 20 full-batch steps over 4 windows at
    half the compute; scoring a quarter of the queries per step then halves the default conversion (103 s ->
    55 s at 0.5) for a ppl ratio 2-6% higher (benchmarks/mla_budget.py --refine-queries 512 against the
    default). ``token_scale`` ([n, L, 1]) weights each token's error; ``layout`` (``window_layout``) says
    where the windows' prompts start (default: one per window)."""
    length, train, device = x.shape[1], x.shape[0] - held_out, x.device
    positions, visible = layout if layout is not None else window_layout(x.shape[0], length)
    positions, visible = positions.to(device), visible.to(device)
    cos, sin = DeepseekV3RotaryEmbedding(config).to(device)(x[:1], positions)
    token_scale = torch.ones(*x.shape[:2], 1, device=device) if token_scale is None else token_scale

    def energy_of(windows: slice) -> torch.Tensor:  # errors are relative to their own windows' target
        return (target[windows] * token_scale[windows]).pow(2).mean()

    energy = energy_of(slice(0, train))

    def closed_form() -> DeepseekV3Attention:
        return mla_attention(config, index, w, o_weight.cpu()).to(device)

    queries = min(length, REFINE_STEP_QUERIES)
    generator = torch.Generator().manual_seed(index)  # on the CPU: the same rows on every device

    def random_rows() -> torch.Tensor:
        return torch.randperm(length, generator=generator)[:queries].sort().values.to(device)

    def output_at(rows: torch.Tensor, windows: slice) -> torch.Tensor:
        return sampled_output(attention, x[windows], (cos[windows], sin[windows]), rows, visible[windows])

    def error_at(rows: torch.Tensor, windows: slice, energy: torch.Tensor = energy) -> torch.Tensor:
        error = output_at(rows, windows) - target[windows][:, rows]
        return (error * token_scale[windows][:, rows]).pow(2).mean() / energy

    @torch.no_grad()
    def error_over(start: int, stop: int) -> float | None:
        if stop <= start:
            return None
        whole = energy_of(slice(start, stop))
        chunks = [slice(i, min(i + at_once, stop)) for i in range(start, stop, at_once)]
        return sum(error_at(checked, chunk, whole).item() * (chunk.stop - chunk.start) for chunk in chunks) / (stop - start)

    at_once = windows_at_once(config.num_attention_heads, length,
                              2 * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) + config.qk_nope_head_dim)
    checked = random_rows()  # the same rows of every window score the closed form and the refined layer
    scored = []
    for candidate in (w, *alternatives):
        attention = mla_attention(config, index, candidate, o_weight.cpu()).to(device)
        scored.append((error_over(0, train), len(scored), candidate))
    before, start, w = min(scored)
    attention = closed_form()
    held_before = error_over(train, x.shape[0])
    per_step = min(train, max(1, REFINE_STEP_TOKENS // length))

    def trained(lr: float) -> int:
        """Adam at ``lr`` from ``attention``, which ends holding the kept weights; the steps kept (0: none)."""
        best = (held_before, 0, None)  # held-out error, steps, state
        optimizer = torch.optim.Adam(refined_parameters(attention), lr=lr, fused=True)
        schedule = learning_rate_schedule(optimizer, replace(settings, lr=lr))
        with torch.enable_grad():
            for step in range(1, settings.steps + 1):
                first = ((step - 1) * per_step) % train
                optimizer.zero_grad()
                error_at(random_rows(), slice(first, min(first + per_step, train))).backward()
                optimizer.step()
                schedule.step()
                if held_out and (step % HELD_OUT_CHECK == 0 or step == settings.steps):
                    held = error_over(train, x.shape[0])
                    if held < best[0]:
                        best = (held, step, {k: v.detach().clone() for k, v in attention.state_dict().items()})
                    elif step - best[1] >= HELD_OUT_PATIENCE * HELD_OUT_CHECK:
                        break
        if held_out:
            if best[2] is not None:
                attention.load_state_dict(best[2])
            return best[1]
        return settings.steps if error_over(0, train) < before else 0

    for lr in backoff_rates(settings.lr):
        if steps := trained(lr):
            break
        attention = closed_form()
    with torch.no_grad():
        every_row = torch.arange(length, device=device)
        output = torch.cat([output_at(every_row, slice(i, i + at_once)) for i in range(0, len(x), at_once)])
    errors = LayerError(before, error_over(0, train), held_before, error_over(train, x.shape[0]), steps,
                        lr if steps else None, start)
    return (weights_of(attention, w) if steps else w), errors, output


def backoff_rates(lr: float) -> list[float]:
    """The learning rates refinement tries in turn, each only if none of the steps at the one before it lowered
    the error (Adam's step is about ``lr`` in every coordinate whatever the gradient's scale, so the rate that
    suits one model's weights overshoots another's: Qwen2.5-Coder-0.5B's q_proj is 13x smaller than
    SmolLM2-135M's, and at 1e-3 no step helped in 15 of its 24 layers)."""
    return [lr / RATE_BACKOFF**k for k in range(RATE_RETRIES + 1)]


def weights_of(attention: DeepseekV3Attention, w: MLAWeights) -> MLAWeights:
    """A refined layer's weights read back from its module (what refinement does not train comes from ``w``)."""
    def read(module: torch.nn.Module, name: str) -> torch.Tensor | None:
        tensor = getattr(module, name)
        return None if tensor is None else tensor.detach().double().cpu()

    if attention.q_b_proj is not None:
        q_b = read(attention.q_b_proj, "weight")
        q_proj, q_bias = q_b[:, :-1], q_b[:, -1]
    else:
        q_proj, q_bias = read(attention.q_proj, "weight"), w.q_bias
    kv_a = attention.kv_a_proj_with_mqa
    return MLAWeights(q_proj, q_bias, read(kv_a, "weight"), read(kv_a, "bias"), read(attention.kv_a_layernorm, "weight"),
                      read(attention.kv_b_proj, "weight"), w.o_bias)


def learning_rate_schedule(optimizer: torch.optim.Optimizer, settings: Refinement) -> torch.optim.lr_scheduler.LRScheduler:
    """Constant, or a cosine decay from the peak to COSINE_FLOOR times the peak over the steps."""
    if settings.schedule == "cosine":
        floor = settings.lr * COSINE_FLOOR
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, settings.steps), eta_min=floor)
    if settings.schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    raise ValueError(f"unknown refinement schedule '{settings.schedule}'; choose {' or '.join(SCHEDULES)}")


class SequentialRefiner:
    """Layer-wise refinement that carries the converted model's own residual stream forward (as GPTQ and
    BRECQ do), so each layer learns to undo the drift of the layers before it: layer l's attention sees
    norm(h'_l) and is fitted to h_l + a_l - h'_l, where h_l, a_l are the original model's residual stream and
    attention output and h'_l is the converted model's residual stream. Both streams advance layer by layer
    from the embeddings, so memory holds two streams whatever the depth. ``starts`` cuts the windows into
    prompts of their own (``calibrate.short_prompt_starts``)."""

    def __init__(self, rotary: torch.nn.Module, family: Family, embeddings: torch.Tensor, config: DeepseekV3Config,
                 held_out: int = 0, starts: torch.Tensor | None = None, device: torch.device | None = None):
        self.device = device or embeddings.device  # where both streams live and each layer is refined
        self.rotary, self.family, self.config, self.held_out = copy.deepcopy(rotary).to(self.device), family, config, held_out
        self.original = embeddings.to(self.device)  # [n, L, D]: the first decoder layer's input on the refinement windows, held-out last
        self.stream = self.original.clone()
        self.layout = tuple(t.to(self.device) for t in window_layout(*embeddings.shape[:2], starts))

    def carried(self) -> dict[str, torch.Tensor]:
        """Both residual streams as the next layer receives them, to resume from (``io.resume``)."""
        return {"original": self.original, "converted": self.stream}

    def resume(self, carried: dict[str, torch.Tensor]) -> None:
        self.original, self.stream = carried["original"].to(self.device), carried["converted"].to(self.device)

    @torch.no_grad()
    def refine(self, index: int, layer: torch.nn.Module, w: MLAWeights, settings: Refinement,
               alternatives: Sequence[MLAWeights] = ()) -> tuple[MLAWeights, LayerError]:
        """Refine decoder layer ``index`` (``layer``: the source's, in float32) from its closed form ``w`` or
        one of its ``alternatives``; the layer is moved to the refiner's device for it and back."""
        with on_device(layer, self.device):
            return self.refine_on_device(index, layer, w, settings, alternatives)

    def refine_on_device(self, index: int, layer: torch.nn.Module, w: MLAWeights, settings: Refinement,
                         alternatives: Sequence[MLAWeights] = ()) -> tuple[MLAWeights, LayerError]:
        source_attn = getattr(layer, self.family.attention_attr)
        norm = getattr(layer, self.family.input_norm)
        attended = self.source_attention(source_attn, norm(self.original))
        target = self.original + attended - self.stream
        token_scale = (self.original + attended).pow(2).mean(-1, keepdim=True).rsqrt()
        w, errors, output = refine_layer(w, self.config, index, source_attn.o_proj.weight, norm(self.stream),
                                         target, settings, token_scale, self.held_out, self.layout, alternatives)
        self.original = self.finish_layer(layer, self.original + attended)
        self.stream = self.finish_layer(layer, self.stream + output)
        return w, errors

    def source_attention(self, attention, x: torch.Tensor) -> torch.Tensor:
        """The original attention's output on every window, a few windows at a time."""
        positions, visible = self.layout
        outputs = []
        at_once = windows_at_once(self.config.num_attention_heads, x.shape[1], 4 * attention.head_dim)
        for i in range(0, len(x), at_once):
            chunk = slice(i, i + at_once)
            rope = self.rotary(x[chunk], positions[chunk])
            outputs.append(attention(hidden_states=x[chunk], position_embeddings=rope,
                                     attention_mask=additive_mask(visible[chunk]))[0])
        return torch.cat(outputs)

    def finish_layer(self, layer, stream: torch.Tensor) -> torch.Tensor:
        """The rest of a decoder layer after its attention's residual add: the MLP's residual add."""
        post_norm = getattr(layer, self.family.post_attention_norm)
        return stream + getattr(layer, self.family.mlp)(post_norm(stream))
