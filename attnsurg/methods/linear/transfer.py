"""Attention transfer (LoLCATs, Zhang et al. 2024, sec. 3.1): each layer's feature maps trained so its hybrid
sliding-window + linear attention gives the softmax attention's output on calibration windows.

Layer-local: every layer is fitted on the source model's own residual stream, carried from the embeddings
through the source's layers, so one layer in memory suffices. Adam on the feature maps alone; the source's
projections stay as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from attnsurg.arch.families import Family
from attnsurg.calibrate import additive_mask, visible_keys
from attnsurg.linalg import orthogonal_gaussian
from attnsurg.modeling.modeling_attnsurg import HybridLinearAttention, hybrid_attention

HELD_OUT_CHECK = 10  # the held-out error is checked every this many steps
HELD_OUT_PATIENCE = 3  # and training stops after this many checks without a new lowest one
DECAY_INIT = 3e-3  # per token (a half-life of 230 tokens): faded after the fact, the demo at window 128 scored best near it


@dataclass(frozen=True)
class Transfer:
    """Attention-transfer settings: Adam steps per layer (one window each) and their learning rate."""

    steps: int = 100
    lr: float = 1e-2


class HybridShape(NamedTuple):
    """What a hybrid attention keeps exact (the last ``window`` keys and the first ``sinks``), its feature map,
    the width of each half of it, whether its linear part decays with distance and whether the maps read
    queries and keys before RoPE."""

    window: int
    feature_dim: int
    sinks: int = 0
    feature_map: str = "hedgehog"
    decay: bool = False
    features_before_rope: bool = False


class TransferError(NamedTuple):
    """A layer's relative output error against the softmax attention, on the windows it trains on and on
    the held-out ones, at the feature maps' initialisation (before) and as kept (after)."""

    before: float
    after: float
    held_before: float | None
    held_after: float | None
    steps: int


def initialised(attention: HybridLinearAttention, generator: torch.Generator | None = None) -> HybridLinearAttention:
    """Hedgehog's initialisation: each feature map the identity on its first F coordinates (F <= head_dim),
    scaled by d^-1/4 so phi(q) . phi(k) starts from the scores' scale. Performer's: F orthogonal random
    directions per KV head, shared by its query heads. The linear part at weight 1, and its decay (where it
    has one) at DECAY_INIT per token."""
    d, features = attention.head_dim, attention.feature_dim
    if attention.feature_map == "performer":
        generator = generator or torch.Generator().manual_seed(0)
        keys = torch.stack([orthogonal_gaussian(features, d, generator).T for _ in range(len(attention.feature_k))])
        queries = keys.repeat_interleave(len(attention.feature_q) // len(keys), dim=0)
    else:
        queries = keys = torch.eye(d, features) * d**-0.25
    with torch.no_grad():
        for weight, bias, value in ((attention.feature_q, attention.feature_q_bias, queries),
                                    (attention.feature_k, attention.feature_k_bias, keys)):
            weight.copy_(value.expand_as(weight))
            bias.zero_()
        attention.linear_scale.zero_()
        if attention.log_decay is not None:
            attention.log_decay.fill_(math.log(DECAY_INIT))
    return attention


def hybrid_output(attention: HybridLinearAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  feature_query: torch.Tensor, feature_key: torch.Tensor) -> torch.Tensor:
    """The hybrid attention's output [n, L, D] on whole windows (queries over every position, no cache)."""
    heads = hybrid_attention(query, key, value, attention.query_features(feature_query),
                             attention.key_features(feature_key),
                             attention.window, attention.scaling, attention.linear_scale, sinks=attention.sinks,
                             anchored=attention.anchored, decay=attention.decay())
    return attention.o_proj(heads.transpose(1, 2).flatten(2))


def added_names(attention: HybridLinearAttention) -> tuple[str, ...]:
    """The tensors a conversion adds to the source's attention, by their names in the module."""
    added = {id(p) for p in attention.added_parameters()}
    return tuple(name for name, p in attention.named_parameters(recurse=False) if id(p) in added)


def feature_parameters(attention: HybridLinearAttention) -> list[torch.nn.Parameter]:
    return [getattr(attention, name) for name in added_names(attention)]


def feature_state(attention: HybridLinearAttention) -> dict[str, torch.Tensor]:
    return {name: getattr(attention, name).detach().clone() for name in added_names(attention)}


def transfer_layer(attention: HybridLinearAttention, x: torch.Tensor, position_embeddings, target: torch.Tensor,
                   settings: Transfer, held_out: int, seed: int = 0) -> TransferError:
    """Fit ``attention``'s feature maps so its output on the windows ``x`` ([n, L, D], the layer's normed input)
    matches ``target`` (the softmax attention's output); the last ``held_out`` windows are never trained on.
    With them, the weights of the lowest held-out error are kept and training stops once it has not fallen
    for HELD_OUT_PATIENCE checks; without them, the last step's weights are kept."""
    train = len(x) - held_out
    with torch.no_grad():
        inputs = attention.rotated(x, position_embeddings)

    def error(windows: slice) -> torch.Tensor:
        output = hybrid_output(attention, *(t[windows] for t in inputs))
        return (output - target[windows]).pow(2).sum() / target[windows].pow(2).sum()

    @torch.no_grad()
    def measured(windows: slice) -> float | None:
        return error(windows).item() if windows.stop > windows.start else None

    training, holding = slice(0, train), slice(train, len(x))
    before, held_before = measured(training), measured(holding)
    best = (held_before if held_out else float("inf"), 0, feature_state(attention))
    optimizer = torch.optim.Adam(feature_parameters(attention), lr=settings.lr)
    order = torch.randperm(train, generator=torch.Generator().manual_seed(seed))
    with torch.enable_grad():
        for step in range(1, settings.steps + 1):
            window = int(order[(step - 1) % train])
            optimizer.zero_grad()
            error(slice(window, window + 1)).backward()
            optimizer.step()
            if held_out and (step % HELD_OUT_CHECK == 0 or step == settings.steps):
                held = measured(holding)
                if held < best[0]:
                    best = (held, step, feature_state(attention))
                elif step - best[1] >= HELD_OUT_PATIENCE * HELD_OUT_CHECK:
                    break
    if held_out:
        load_features(attention, best[2])
        kept = best[1]
    else:
        kept = settings.steps
    return TransferError(before, measured(training), held_before, measured(holding), kept)


def load_features(attention: HybridLinearAttention, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in state.items():
            getattr(attention, name).copy_(tensor)


def hybrid_of(source_attention: torch.nn.Module, config, index: int, shape: HybridShape,
              seed: int = 0) -> HybridLinearAttention:
    """A hybrid attention over the source attention's own projections (shared, not copied), initialised
    (random features drawn from ``seed``)."""
    a = source_attention
    hybrid = HybridLinearAttention(config, index, a.q_proj, a.k_proj, a.v_proj, a.o_proj, *shape)
    hybrid.carry_norms(a)
    return initialised(hybrid, torch.Generator().manual_seed(seed)).to(a.q_proj.weight.device)


class LayerTransfer:
    """Both halves of a layer's attention transfer on the source's residual stream: the softmax attention's
    output on every window (the target), then the stream carried through the source layer to the next."""

    def __init__(self, family: Family, rotary: torch.nn.Module, stream: torch.Tensor):
        self.family, self.rotary, self.stream = family, rotary, stream
        positions = torch.arange(stream.shape[1])[None].expand(len(stream), -1)
        self.position_embeddings = rotary(stream, positions)
        self.mask = additive_mask(visible_keys(stream.shape[1])[None].expand(len(stream), -1, -1))

    @torch.no_grad()
    def fit(self, layer: torch.nn.Module, config, index: int, shape: HybridShape, settings: Transfer,
            held_out: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], TransferError]:
        """The fitted feature tensors of layer ``index`` and its errors; the stream moves past the layer."""
        x, target = self.layer_io(layer)
        features, errors = self.fitted(layer, x, target, config, index, shape, settings, held_out, seed)
        self.advance(layer, target)
        return features, errors

    @torch.no_grad()
    def layer_io(self, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's attention input (normed stream) and the softmax attention's output on every window."""
        source = getattr(layer, self.family.attention_attr)
        x = getattr(layer, self.family.input_norm)(self.stream)
        return x, source(hidden_states=x, position_embeddings=self.position_embeddings, attention_mask=self.mask)[0]

    def fitted(self, layer: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, config, index: int,
               shape: HybridShape, settings: Transfer, held_out: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], TransferError]:
        hybrid = hybrid_of(getattr(layer, self.family.attention_attr), config, index, shape, seed + index)
        errors = transfer_layer(hybrid, x, self.position_embeddings, target, settings, held_out, seed + index)
        return feature_state(hybrid), errors

    @torch.no_grad()
    def advance(self, layer: torch.nn.Module, attended: torch.Tensor) -> None:
        """The stream through the rest of the source layer: the attention's residual add, then the MLP's."""
        residual = self.stream + attended
        post = getattr(layer, self.family.post_attention_norm)
        self.stream = residual + getattr(layer, self.family.mlp)(post(residual))
