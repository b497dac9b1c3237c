"""Which layers of a hybrid conversion keep softmax attention over the whole context (``--retrieval-layers N``),
chosen by measurement on the source: the layers whose heads copy from far back.

Retrieval ("the number for KEY is ...") is done by induction heads: a query attends to the token after an
earlier occurrence of what it just read, however far back (Olsson et al. 2022). The probe is that task bare: a
segment of random tokens, a stretch of the calibration text longer than the window, and the segment again; a
layer's score is its best head's mean attention from each token of the second copy to the token after its match
in the first copy. A window-plus-state layer cannot place that attention on one key a window back, so the layers
that score highest keep it exact (DuoAttention, Xiao et al. 2025, picks retrieval heads on synthetic passkey
data the same way).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel

from attnsurg.arch.families import Family
from attnsurg.calibrate import embedded, streamed_layers
from attnsurg.heads import head_projections, layer_masking, softmax_scale
from attnsurg.io.lazy import rotary_embedding

PROBE_SEGMENT = 128  # random tokens, repeated once
PROBE_RUNS = 2  # probes, each with its own segment
PROBE_GAP_WINDOWS = 4  # the calibration text between the copies, in windows of exact attention


def induction_probe(windows: torch.Tensor, vocab_size: int, gap: int, seed: int = 0) -> torch.Tensor:
    """[PROBE_RUNS, 2 * PROBE_SEGMENT + gap] token ids: segment, ``gap`` calibration tokens, segment."""
    filler = windows.flatten()
    if len(filler) < gap:
        filler = filler.repeat(-(-gap // len(filler)))
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for run in range(PROBE_RUNS):
        segment = torch.randint(0, vocab_size, (PROBE_SEGMENT,), generator=generator)
        rows.append(torch.cat([segment, filler[run * gap // PROBE_RUNS :][:gap], segment]))
    return torch.stack(rows)


def copy_attention(probabilities: torch.Tensor) -> torch.Tensor:
    """[heads]: from the second copy's attention rows [heads, PROBE_SEGMENT, L], each head's mean attention from
    a token to the token after its match in the first copy."""
    offsets = torch.arange(PROBE_SEGMENT - 1)
    return probabilities[:, offsets, offsets + 1].mean(-1)


def second_copy_probabilities(query: torch.Tensor, key: torch.Tensor, scale: float, window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """[heads, PROBE_SEGMENT, L]: causal softmax attention of the last PROBE_SEGMENT queries alone (post-RoPE
    [heads, L, d], keys repeated to the query heads), so memory holds those rows and not L x L."""
    length = query.shape[1]
    rows = torch.arange(length - PROBE_SEGMENT, length)
    scores = (query[:, rows] @ key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    distance = rows[:, None] - torch.arange(length)[None]
    visible = (distance >= 0) & (distance < window if window is not None else True)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


@torch.no_grad()
def layer_copying(layer: torch.nn.Module, inputs: torch.Tensor, family: Family, rope) -> float:
    """A decoder layer's score on the probes ([runs, L, D], the stream entering it): its best head's copying,
    averaged over the probes."""
    attention = getattr(layer, family.attention_attr)
    x = getattr(layer, family.input_norm)(inputs)
    scale, masking = softmax_scale(attention), layer_masking(attention)
    scores = []
    for row in x:
        _, _, _, query, key = head_projections(attention, row[None], rope)
        key = key.repeat_interleave(query.shape[0] // key.shape[0], dim=0)
        scores.append(copy_attention(second_copy_probabilities(query, key, scale, **masking)).max())
    return float(torch.stack(scores).mean())


@torch.no_grad()
def copying_scores(reader, config: PretrainedConfig, family: Family, windows: torch.Tensor, window: int,
                   device: torch.device | None = None, seed: int = 0, model: PreTrainedModel | None = None) -> list[float]:
    """Every layer's ``layer_copying`` on probes built from the calibration ``windows``, the layers read from
    ``reader`` one at a time or taken from ``model`` in memory."""
    from attnsurg.modeling.modeling_attnsurg import layer_rotary
    from attnsurg.methods.layerwise import embedded_windows

    gap = PROBE_GAP_WINDOWS * window
    probe = induction_probe(windows, config.vocab_size, gap, seed)
    if model is None:
        stream, layers = embedded(reader, config, family, probe), None
    else:
        stream, layers = embedded_windows(model, probe), model.get_submodule(family.layers_path)
    rotary = rotary_embedding(config)
    positions = torch.arange(probe.shape[1])[None]
    scores, inputs = [], stream
    for index, layer, _, advanced in streamed_layers(reader, config, family, stream, (), device, layers=layers):
        rope = layer_rotary(rotary, config, index)(inputs[:1].cpu(), positions)
        scores.append(layer_copying(layer, inputs.cpu(), family, rope))
        inputs = advanced
    return scores


def most_copying(scores: list[float], count: int) -> tuple[int, ...]:
    """The ``count`` layers that copy most, in layer order."""
    ranked = sorted(range(len(scores)), key=lambda index: -scores[index])
    return tuple(sorted(ranked[:count]))
