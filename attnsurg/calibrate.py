"""Calibration: statistics of what attention sees, captured with hooks over calibration text.

Everything is accumulated in float64 on the compute device whatever the model dtype. Inputs are *augmented* with a
constant 1 (x~ = [x; 1]), so a single second moment E[x~ x~^T] also carries the mean, and any affine map
W x + b has output second moment [W b] E[x~ x~^T] [W b]^T: biases need no special case anywhere.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import partial
from itertools import pairwise

import torch
from torch import nn

from attnsurg import ui
from attnsurg.arch.families import Family
from attnsurg.data import load_text, parse_datasets
from attnsurg.errors import UserError
from attnsurg.requests import TextData


def calibration_windows(tokenizer, data: TextData, num_tokens: int, seq_len: int) -> torch.Tensor:
    """``[n, seq_len]`` token windows from the calibration part of the data (never its evaluation part). Several
    datasets (a comma list, or ``all`` six domains) share the windows in turn: window i comes from dataset
    i mod k, each dataset's windows taken from its start, so any leading share of the windows mixes them."""
    if data.dataset and data.text is None and len(names := parse_datasets(data.dataset)) > 1:
        return mixed_windows(tokenizer, names, num_tokens, seq_len)
    text = load_text(data.dataset, data.text, "calib")
    ids = tokenizer(text.text, add_special_tokens=False)["input_ids"][:num_tokens]
    n = len(ids) // seq_len
    if n == 0:
        raise UserError(
            f"calibration text '{text.name}' has {len(ids)} tokens, fewer than one window of {seq_len}"
        )
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def mixed_windows(tokenizer, names: list[str], num_tokens: int, seq_len: int) -> torch.Tensor:
    count = max(1, num_tokens // seq_len)
    shares = [len(range(i, count, len(names))) for i in range(len(names))]
    per_dataset = [calibration_windows(tokenizer, TextData(dataset=name, part="calib"), share * seq_len, seq_len)
                   for name, share in zip(names, shares) if share]
    rows = [windows[j] for j in range(max(shares)) for windows in per_dataset if j < len(windows)]
    return torch.stack(rows)


SHORT_PROMPT_TOKENS = (8, 128)  # the lengths of the short prompts cut from the end of each calibration window


def short_prompt_starts(windows: torch.Tensor, share: float, seed: int = 0) -> torch.Tensor:
    """``[n, L]`` bool, True where a prompt of its own starts (its positions restart at 0 and it sees nothing
    before it). Every window starts one; with ``share`` > 0 the window's last ``share`` of tokens is cut into
    prompts of SHORT_PROMPT_TOKENS lengths (uniformly drawn), so every window, and so every domain of a
    mixed calibration, also holds the first positions that short prompts are made of."""
    n, length = windows.shape
    starts = torch.zeros(n, length, dtype=torch.bool)
    starts[:, 0] = True
    short = round(length * share)
    if short == 0:
        return starts
    generator = torch.Generator().manual_seed(seed)
    low, high = SHORT_PROMPT_TOKENS
    for row in starts:
        position = length - short
        while position < length:
            row[position] = True
            position += int(torch.randint(low, high + 1, (1,), generator=generator))
    return starts


def prompt_layout(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window, each token's position in its prompt ``[n, L]`` and which tokens each token sees
    ``[n, L, L]`` (causal within its prompt)."""
    length = starts.shape[1]
    index = torch.arange(length).expand_as(starts)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    prompt = starts.long().cumsum(dim=1)
    visible = (prompt[:, :, None] == prompt[:, None, :]) & (index[:, :, None] >= index[:, None, :])
    return index - first, visible


def prompts_of(window: torch.Tensor, starts: torch.Tensor | None) -> list[torch.Tensor]:
    """A window's prompts, in order."""
    if starts is None:
        return [window]
    bounds = torch.nonzero(starts).flatten().tolist() + [len(window)]
    return [window[a:b] for a, b in pairwise(bounds)]


def augment(x: torch.Tensor) -> torch.Tensor:
    """Rows of x with a constant 1 appended, in float64."""
    x = x.reshape(-1, x.shape[-1]).double()
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)


def attention_layers(model: nn.Module, family: Family) -> list[nn.Module]:
    layers = model.get_submodule(family.layers_path)
    return [getattr(layer, family.attention_attr) for layer in layers]


def attention_inputs(model: nn.Module, family: Family, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the attention input (after the input norm) on every window: ``[n, seq_len, D]``, CPU float32."""
    return captured_inputs(model, attention_layers(model, family), windows)


@torch.no_grad()  # not inference_mode: refinement trains on these tensors
def captured_inputs(model: nn.Module, modules: list[nn.Module], windows: torch.Tensor) -> list[torch.Tensor]:
    """The ``hidden_states`` each module receives while the model runs over the windows."""
    captured: list[list[torch.Tensor]] = [[] for _ in modules]
    run_with_input_hooks(model, modules, windows, lambda i, x, kwargs: captured[i].append(x.detach().float().cpu()))
    return [torch.cat(chunks) for chunks in captured]


def run_with_input_hooks(model: nn.Module, modules: list[nn.Module], windows: torch.Tensor, receive,
                         starts: torch.Tensor | None = None) -> None:
    """Run the model over each window (each of its prompts on its own, given ``starts``), calling
    ``receive(i, x, kwargs)`` with the input of ``modules[i]`` and the other arguments it is called with."""

    def hook_for(index: int):
        def hook(module, args, kwargs):
            receive(index, kwargs.get("hidden_states", args[0] if args else None), kwargs)

        return hook

    handles = [m.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, m in enumerate(modules)]
    device = next(model.parameters()).device
    try:
        with ui.progress_bar("Calibrating", total=len(windows), unit="windows") as advance:
            for i, window in enumerate(windows):
                for prompt in prompts_of(window, None if starts is None else starts[i]):
                    model(input_ids=prompt[None].to(device), use_cache=False, logits_to_keep=1)  # the hooks see it all
                advance()
    finally:
        for handle in handles:
            handle.remove()


def second_moment(x: torch.Tensor) -> torch.Tensor:
    """E[x~ x~^T] ((D+1) x (D+1), float64) over all tokens of x."""
    xa = augment(x)
    return xa.T @ xa / xa.shape[0]


def attention_input_moments(model: nn.Module, family: Family, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, E[x~ x~^T] of the attention input."""
    return [second_moment(x) for x in attention_inputs(model, family, windows)]


class InputStatistics:
    """Streaming E[x~ x~^T] (augmented, float64) and E|x| of what one module receives ([windows, L, n]),
    E[x~ x~^T] over each prompt's first token alone (where the attention sink is), and, for an attention
    layer given what each token receives (``heads.received_attention``), E[w x~ x~^T] weighted by it."""

    def __init__(self) -> None:
        self.tokens = self.windows = 0
        self.moment: torch.Tensor | None = None
        self.first_moment: torch.Tensor | None = None
        self.received_moment: torch.Tensor | None = None
        self.abs_sum: torch.Tensor | None = None

    def add(self, x: torch.Tensor, received: torch.Tensor | None = None, starts: torch.Tensor | None = None) -> None:
        """Accumulate on the device ``x`` is on (a GPU's float64 is far faster than the CPU's); the
        statistics read back on the CPU, where the decompositions run. ``received``: [windows, L], the
        attention each token receives; ``starts``: [windows, L] bool, where a prompt of its own starts (each
        window's first token when not given)."""
        x = x.detach()
        xa = augment(x)
        if starts is not None:
            first = augment(x[starts.to(x.device)])
        else:
            first = augment(x[:, 0]) if x.ndim == 3 else xa[:0]
        if self.moment is None:
            self.moment = torch.zeros(xa.shape[1], xa.shape[1], dtype=torch.float64, device=x.device)
            self.first_moment = torch.zeros_like(self.moment)
            self.abs_sum = torch.zeros(xa.shape[1] - 1, dtype=torch.float64, device=x.device)
        self.moment += xa.T @ xa
        self.first_moment += first.T @ first
        if received is not None:
            weighted = xa * received.reshape(-1, 1).to(xa)
            self.received_moment = weighted.T @ xa + (0 if self.received_moment is None else self.received_moment)
        self.abs_sum += xa[:, :-1].abs().sum(0)
        self.tokens += xa.shape[0]
        self.windows += first.shape[0]

    def offloaded(self) -> InputStatistics:
        """The same statistics with their sums moved to the CPU (to keep many layers' without GPU memory)."""
        for name in ("moment", "first_moment", "received_moment", "abs_sum"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).cpu())
        return self

    @property
    def sigma(self) -> torch.Tensor:
        """E[x~ x~^T], (n+1) x (n+1)."""
        return (self.moment / self.tokens).cpu()

    @property
    def sigma_first(self) -> torch.Tensor | None:
        """E[x~ x~^T] over the windows' first tokens, (n+1) x (n+1)."""
        return (self.first_moment / self.windows).cpu() if self.windows else None

    @property
    def sigma_received(self) -> torch.Tensor | None:
        """E[w x~ x~^T], w the attention each token receives (mean 1 over a window): the tokens the layer's
        output reads most, weighted most. An error e_j in token j's value moves query i's output by
        sum_j p_ij e_j, whose mean square over the queries is at most E[w_j |e_j|^2] (Jensen), and a key's
        error reaches the output through the same p_ij."""
        return (self.received_moment / self.tokens).cpu() if self.received_moment is not None else None

    @property
    def abs_mean(self) -> torch.Tensor:
        return (self.abs_sum / self.tokens).cpu()


@torch.no_grad()
def input_statistics(model: nn.Module, modules: list[nn.Module], windows: torch.Tensor,
                     starts: torch.Tensor | None = None, device: torch.device | None = None,
                     received: Collection[nn.Module] = ()) -> list[InputStatistics]:
    """Second moment and mean magnitude of each module's input over the windows (their prompts, given
    ``starts``), accumulated with hooks; with ``device``, the model runs there for the pass. The statistics of
    the ``received`` ones (attention layers) also weigh each token by the attention it receives."""
    from attnsurg.placement import on_device

    stats = [InputStatistics() for _ in modules]
    weighed = {id(module) for module in received}

    def receive(index: int, x: torch.Tensor, kwargs: dict) -> None:
        stats[index].add(x, received_by(modules[index], x, kwargs) if id(modules[index]) in weighed else None)

    with on_device(model, device):
        run_with_input_hooks(model, modules, windows, receive, starts)
    names = {id(module): name for name, module in model.named_modules()}
    check_finite(stats, [names.get(id(module), f"hooked module {i}") for i, module in enumerate(modules)])
    return stats


def received_by(attention: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """``heads.received_attention`` of the attention layer a hook sees called on ``x`` with ``kwargs``."""
    from attnsurg.heads import received_attention

    return received_attention(attention, x, kwargs["position_embeddings"])


def check_finite(stats: list[InputStatistics], names: list[str] | None = None) -> None:
    """NaN or infinity in what the model computes on the calibration text is a broken checkpoint (corrupt
    weights, or a dtype that overflows), never something to decompose."""
    for index, s in enumerate(stats):
        if s.moment is not None and not bool(torch.isfinite(s.moment).all()):
            where = names[index] if names else f"hooked module {index}"
            raise UserError(f"the model's activations on the calibration text are not finite (NaN or infinity, first "
                            f"at the input of {where}): its weights are corrupt or overflow their dtype; check it "
                            "with `attnsurg eval perplexity MODEL`")


def visible_keys(length: int, window: int | None = None, device=None) -> torch.Tensor:
    """[L, L] bool: the keys each query attends to: causal, and within the last ``window`` tokens (itself
    included) on a sliding layer."""
    visible = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return visible if window is None else visible & ~torch.ones_like(visible).tril(-window)


def causal_mask(length: int, window: int | None = None) -> torch.Tensor:
    """Additive [1, 1, L, L] causal mask, explicit so every attention implementation honours it; with a sliding
    ``window`` (Mistral's layers, Gemma's sliding ones), only the keys ``visible_keys`` shows."""
    return additive_mask(visible_keys(length, window)[None])


def additive_mask(visible: torch.Tensor) -> torch.Tensor:
    """[n, 1, L, L] additive mask from which keys each query sees ([n, L, L] bool)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, torch.finfo(torch.float32).min)[:, None]


def streamed_layers(reader, config, family: Family, stream: torch.Tensor, hooked: tuple[str, ...],
                    device: torch.device | None = None, start: int = 0, received: tuple[str, ...] = (),
                    starts: torch.Tensor | None = None, layers: Sequence[nn.Module] | None = None):
    """Each decoder layer from ``start`` on, read alone (``io.lazy``) and run over the residual stream of every
    window ([n, L, D], float32: layer ``start``'s input, the embeddings from the first), one layer in memory at a
    time: yields ``(index, layer, statistics, stream)``, the ``InputStatistics`` of each ``hooked`` submodule over
    the windows and the stream the layer has advanced. With ``device``, the stream and each layer's pass live
    there; the layer is yielded back on the CPU. The ``received`` ones among the hooked (attention layers) also
    weigh each token by the attention it receives. ``starts`` ([n, L] bool, ``short_prompt_starts``) cuts the
    windows into prompts that each see only themselves, from position 0, as if run alone. ``layers``: the decoder
    layers of a model in memory (float32), taken instead of reading them."""
    from attnsurg.io.lazy import load_layer, rotary_embedding
    from attnsurg.modeling.modeling_attnsurg import layer_rotary, layer_window
    from attnsurg.placement import on_device

    if starts is not None and received:
        raise ValueError("attention received is measured over whole windows; it cannot be weighed on short prompts")
    stream = stream.to(device or stream.device)
    rotary = rotary_embedding(config).to(stream.device)
    for index in range(start, config.num_hidden_layers):
        layer = layers[index] if layers is not None else load_layer(reader, config, index, prefix=family.layers_path)
        stats = {name: InputStatistics() for name in hooked}
        current = {}

        def hook(module, args, kwargs, name: str):
            x = kwargs.get("hidden_states", args[0] if args else None)
            stats[name].add(x, received_by(module, x, kwargs) if name in received else None, current.get("starts"))

        handles = [layer.get_submodule(name).register_forward_pre_hook(partial(hook, name=name), with_kwargs=True)
                   for name in hooked]
        try:
            advanced = []
            with on_device(layer, stream.device):
                for chunk, rope, mask, current["starts"] in chunk_passes(stream, layer_rotary(rotary, config, index),
                                                                         layer_window(config, index), starts):
                    advanced.append(layer(chunk, attention_mask=mask, position_embeddings=rope))
            stream = torch.cat(advanced)
        finally:
            for handle in handles:
                handle.remove()
        check_finite([stats[name] for name in hooked], [f"layer {index} {name}" for name in hooked])
        yield index, layer, [stats[name] for name in hooked], stream


STREAM_CHUNK = 8  # windows through a layer at a time


def chunk_passes(stream: torch.Tensor, rotary: nn.Module, window: int | None, starts: torch.Tensor | None):
    """What each chunk of windows runs a layer with: its stream, RoPE, additive mask and prompt starts. Plain
    windows share one causal mask; ``starts`` gives each prompt its own positions from 0 and keys."""
    length, on = stream.shape[1], stream.device
    if starts is None:
        rope = rotary(stream[:1], torch.arange(length, device=on)[None])
        mask = causal_mask(length, window).to(on)
        for chunk in stream.split(STREAM_CHUNK):
            yield chunk, rope, mask, None
        return
    positions, visible = prompt_layout(starts)
    keys = visible_keys(length, window)
    for chunk, position, seen, first in zip(stream.split(STREAM_CHUNK), positions.split(STREAM_CHUNK),
                                           visible.split(STREAM_CHUNK), starts.split(STREAM_CHUNK)):
        yield chunk, rotary(chunk, position.to(on)), additive_mask((seen & keys).to(on)), first


@torch.no_grad()
def streamed_input_statistics(reader, config, family: Family, windows: torch.Tensor,
                              hooked: tuple[str, ...] = ("self_attn", "self_attn.o_proj"), device: torch.device | None = None):
    """Per layer, the input statistics of the ``hooked`` submodules of each decoder layer over the windows, with
    one layer in memory at a time (``streamed_layers``). Equals ``input_statistics`` on the loaded model."""
    return [[s.offloaded() for s in stats]
            for _, _, stats, _ in streamed_layers(reader, config, family, embedded(reader, config, family, windows), hooked,
                                                  device)]


def embedded(reader, config, family: Family, windows: torch.Tensor) -> torch.Tensor:
    """The windows' token embeddings ([n, L, D], float32) read from a checkpoint: the first decoder layer's input
    (Gemma's scaled as its embedding layer scales them)."""
    from attnsurg.io.lazy import embedding_scale

    rows = reader.tensor(f"{family.layers_path.rsplit('.', 1)[0]}.embed_tokens.weight")[windows].float()
    scale = embedding_scale(config)
    return rows if scale == 1.0 else rows * scale
