"""Capture each analysed layer's Q, K and V on real text and reduce them to spectra and sparsity, one window
at a time (nothing but running sums and the report is kept)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from attnsurg import ui
from attnsurg.analyze.report import (
    STORED_VALUES,
    AnalysisReport,
    ApproxReport,
    HeadSparsity,
    LayerApprox,
    LayerAnalysis,
    ProjectionSpectra,
    Spectrum,
    write_json,
)
from attnsurg.sparsity import TOP_SHARES, entropy_ratio, sink_mass, top_mass
from attnsurg.analyze.spectra import (
    energy_rank,
    frequency_energy,
    head_rows,
    moment_spectrum,
    singular_values,
)
from attnsurg.arch.anatomy import AttentionAnatomy
from attnsurg.arch.families import Family, family_for_surgery
from attnsurg.calibrate import attention_layers, calibration_windows, run_with_input_hooks
from attnsurg.errors import UserError
from attnsurg.heads import attention_probabilities, head_projections, layer_masking, softmax_scale
from attnsurg.info import inspect_model
from attnsurg.io.load import resolve_device
from attnsurg.io.save import staged_checkpoint
from attnsurg.pipelines.source import load_source
from attnsurg.placement import on_device
from attnsurg.requests import AnalyzeRequest, ApproxRequest


def spectrum_of(values: torch.Tensor) -> Spectrum:
    values = values.double().cpu()
    return Spectrum(size=len(values), values=values[:STORED_VALUES].tolist(),
                    rank90=energy_rank(values, 0.9), rank99=energy_rank(values, 0.99))


def weight_spectra(attention: nn.Module, anatomy: AttentionAnatomy) -> dict[str, ProjectionSpectra]:
    """q, k, v, o weight spectra, whole and per KV head (q: the rows of each KV group's query heads; o: the
    columns they feed)."""
    d, kv_heads = anatomy.head_dim, anatomy.num_kv_heads
    group = anatomy.num_heads // kv_heads * d
    weights = {name: getattr(attention, f"{name}_proj").weight for name in "qkvo"}
    rows = {"q": group, "k": d, "v": d}
    spectra = {}
    for name, weight in weights.items():
        if name == "o":
            parts = [weight[:, g * group : (g + 1) * group] for g in range(kv_heads)]
        else:
            parts = [head_rows(weight, g, rows[name]) for g in range(kv_heads)]
        spectra[name] = ProjectionSpectra(whole=spectrum_of(singular_values(weight)),
                                          per_kv_head=[spectrum_of(singular_values(p)) for p in parts])
    return spectra


@dataclass
class LayerAccumulator:
    """Running sums for one layer over the windows: second moments of keys (before and after RoPE) and
    values per KV head, of all keys and values together, the queries' diagonal, and per-head attention
    statistics on the first ``attention_windows`` windows."""

    index: int
    attention: nn.Module
    anatomy: AttentionAnatomy
    attention_windows: int
    tokens: int = 0
    windows: int = 0
    moments: dict[str, torch.Tensor] = field(default_factory=dict)
    top: torch.Tensor | None = None  # [heads, shares], summed over attention windows
    sink: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    attention_spectra: list[Spectrum] = field(default_factory=list)

    def add(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        query, key, value, query_post, key_post = head_projections(self.attention, hidden, rope)
        length = query.shape[1]
        self.accumulate("key_pre", torch.einsum("gld,gle->gde", key.double(), key.double()))
        self.accumulate("key_post", torch.einsum("gld,gle->gde", key_post.double(), key_post.double()))
        self.accumulate("value", torch.einsum("gld,gle->gde", value.double(), value.double()))
        joint = torch.cat([key.transpose(0, 1).reshape(length, -1), value.transpose(0, 1).reshape(length, -1)], dim=1).double()
        self.accumulate("joint", joint.T @ joint)
        self.accumulate("query_diagonal", query.double().pow(2).sum(dim=(0, 1)))
        self.tokens += length
        if self.windows < self.attention_windows:
            self.add_attention(query_post, key_post)
        self.windows += 1

    def accumulate(self, name: str, value: torch.Tensor) -> None:
        self.moments[name] = self.moments[name] + value if name in self.moments else value

    def add_attention(self, query: torch.Tensor, key: torch.Tensor) -> None:
        groups = self.anatomy.num_heads // self.anatomy.num_kv_heads
        scale = softmax_scale(self.attention)
        masking = layer_masking(self.attention)
        probabilities = attention_probabilities(query, key.repeat_interleave(groups, dim=0), scale, **masking)
        top = top_mass(probabilities, TOP_SHARES, window=masking["window"]).double()
        sink, entropy = sink_mass(probabilities).double(), entropy_ratio(probabilities, window=masking["window"])
        self.top = top if self.top is None else self.top + top
        self.sink = sink if self.sink is None else self.sink + sink
        self.entropy = entropy if self.entropy is None else self.entropy + entropy
        if not self.attention_spectra:  # the first window's attention matrices
            self.attention_spectra = [spectrum_of(torch.linalg.svdvals(p)) for p in probabilities]

    def result(self) -> LayerAnalysis:
        m, n = self.moments, self.tokens
        seen = min(self.windows, self.attention_windows)
        shares = [f"{share:.0%}" for share in TOP_SHARES]
        key_energy = [frequency_energy(moment / n) for moment in m["key_pre"]]
        query_energy = frequency_energy(torch.diag(m["query_diagonal"] / n))
        return LayerAnalysis(
            index=self.index,
            weights=weight_spectra(self.attention, self.anatomy),
            keys_pre_rope=[spectrum_of(moment_spectrum(moment / n)) for moment in m["key_pre"]],
            keys_post_rope=[spectrum_of(moment_spectrum(moment / n)) for moment in m["key_post"]],
            values=[spectrum_of(moment_spectrum(moment / n)) for moment in m["value"]],
            kv_joint=spectrum_of(moment_spectrum(m["joint"] / n)),
            key_frequency_energy=[(e / e.sum()).tolist() for e in key_energy],
            query_frequency_energy=(query_energy / query_energy.sum()).tolist(),
            heads=[HeadSparsity(top=dict(zip(shares, (self.top[h] / seen).tolist(), strict=True)),
                                sink=float(self.sink[h] / seen), entropy=float(self.entropy[h] / seen),
                                attention=self.attention_spectra[h])
                   for h in range(self.anatomy.num_heads)],
        )


def chosen_layers(layers: list[int] | None, num_layers: int) -> list[int]:
    if layers is None:
        return list(range(num_layers))
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise UserError(f"--layers {','.join(map(str, bad))}: the model has layers 0-{num_layers - 1}")
    return sorted(set(layers))


@torch.no_grad()
def analyze_layers(model: nn.Module, family: Family, anatomy: AttentionAnatomy, windows: torch.Tensor,
                   layers: list[int], attention_windows: int) -> list[LayerAnalysis]:
    """Run the model over the windows once, each analysed layer's attention input reduced as it passes."""
    attentions = attention_layers(model, family)
    accumulators = [LayerAccumulator(i, attentions[i], anatomy, attention_windows) for i in layers]
    device = next(model.parameters()).device
    positions = torch.arange(windows.shape[1], device=device)[None]
    rotaries = [family.layer_rotary(model, i) for i in layers]
    ropes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def receive(slot: int, hidden: torch.Tensor, kwargs: dict) -> None:
        if slot not in ropes:
            ropes[slot] = rotaries[slot](hidden, positions)
        accumulators[slot].add(hidden, ropes[slot])

    run_with_input_hooks(model, [attentions[i] for i in layers], windows, receive)
    with ui.status("Reducing the spectra..."):
        return [accumulator.result() for accumulator in accumulators]


@dataclass
class Loaded:
    """The model in float32 on the CPU, its anatomy, family and the windows of text it is analysed on."""

    model: nn.Module
    anatomy: AttentionAnatomy
    family: Family
    windows: torch.Tensor


@dataclass
class Checked:
    """What a request resolved to before anything loads."""

    source: object
    anatomy: AttentionAnatomy
    family: Family
    device: torch.device


def check_request(request: AnalyzeRequest | ApproxRequest) -> Checked:
    """Everything that can be refused before loading: the model, its family, the layers, the device."""
    source, _, anatomy = inspect_model(request.model)
    family = family_for_surgery(anatomy.model_type)  # the families whose attention layout the capture reads
    chosen_layers(request.layers, anatomy.num_layers)
    return Checked(source, anatomy, family, resolve_device(request.device))


def analysis_reads(request: AnalyzeRequest | ApproxRequest, checked: Checked) -> list[Path]:
    """What an analysis reads, which its output must never replace (``io.guard``)."""
    reads = [checked.source.files] if checked.source.is_local else []
    return reads + ([Path(request.data.text)] if request.data.text is not None else [])


def load_for_analysis(request: AnalyzeRequest | ApproxRequest, checked: Checked, tokens: int) -> Loaded:
    source, anatomy = checked.source, checked.anatomy
    model, tokenizer = load_source(request.model, source)
    seq_len = min(request.seq_len, anatomy.max_positions or request.seq_len)
    return Loaded(model, anatomy, checked.family,
                  calibration_windows(tokenizer, request.data, max(tokens, seq_len), seq_len))


def run_analysis(request: AnalyzeRequest) -> tuple[AnalysisReport, list[Path]]:
    """Analyse the model's attention and write the report (JSON, schema, plots) into ``request.output``."""
    from attnsurg.analyze.plots import write_plots

    started = time.perf_counter()
    checked = check_request(request)
    anatomy, device = checked.anatomy, checked.device
    layers = chosen_layers(request.layers, anatomy.num_layers)
    with staged_checkpoint(request.output, request.overwrite, analysis_reads(request, checked)) as staging:
        loaded = load_for_analysis(request, checked, request.tokens)
        with on_device(loaded.model, device):
            analysed = analyze_layers(loaded.model, loaded.family, anatomy, loaded.windows, layers,
                                      request.attention_windows)
        report = AnalysisReport(
            model=request.model.ref, text=request.data.dataset or str(request.data.text), tokens=loaded.windows.numel(),
            seq_len=loaded.windows.shape[1], attention_windows=min(request.attention_windows, len(loaded.windows)),
            head_dim=anatomy.head_dim, num_heads=anatomy.num_heads, num_kv_heads=anatomy.num_kv_heads,
            rope_theta=anatomy.rope_theta, layers=analysed)
        with ui.status("Plotting..."):
            plots = write_plots(report, staging)
        report.seconds = time.perf_counter() - started
        files = write_json(report, staging, "analysis") + plots
    return report, [request.output / f.name for f in files]


def default_approx_layers(num_layers: int) -> list[int]:
    return sorted({0, num_layers // 2, num_layers - 1})


@torch.no_grad()
def captured_heads(loaded: Loaded, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """Per layer, the first window's post-RoPE queries, keys and values per query head (keys and values
    repeated to their query heads) and the softmax scale."""
    attentions = attention_layers(loaded.model, loaded.family)
    a = loaded.anatomy
    device = next(loaded.model.parameters()).device
    captured = {}

    def receive(slot: int, hidden: torch.Tensor, kwargs: dict) -> None:
        attention = attentions[layers[slot]]
        rope = loaded.family.layer_rotary(loaded.model, layers[slot])(hidden, torch.arange(hidden.shape[1], device=device)[None])
        _, _, value, query, key = head_projections(attention, hidden, rope)
        groups = a.num_heads // a.num_kv_heads
        scale = softmax_scale(attention)
        captured[layers[slot]] = (query.cpu(), key.repeat_interleave(groups, 0).cpu(),
                                  value.repeat_interleave(groups, 0).cpu(), scale)

    run_with_input_hooks(loaded.model, [attentions[i] for i in layers], loaded.windows[:1], receive)
    return captured


def run_approx(request: ApproxRequest) -> tuple[ApproxReport, list[Path]]:
    """Each approximation family's output error on the model's own Q, K, V at each budget, per layer; the
    report (JSON, schema, one plot) written into ``request.output``."""
    from attnsurg.analyze.approx import BIDIRECTIONAL, family_errors
    from attnsurg.analyze.plots import approx_figure

    started = time.perf_counter()
    checked = check_request(request)
    anatomy, device = checked.anatomy, checked.device
    layers = default_approx_layers(anatomy.num_layers) if request.layers == [] else chosen_layers(request.layers, anatomy.num_layers)
    with staged_checkpoint(request.output, request.overwrite, analysis_reads(request, checked)) as staging:
        loaded = load_for_analysis(request, checked, request.seq_len)
        with on_device(loaded.model, device):
            captured = captured_heads(loaded, layers)
        results = []
        with ui.progress_bar("Approximating", total=len(layers), unit="layers") as advance:
            for index in layers:
                results.append(LayerApprox(index=index, errors=family_errors(*captured[index], tuple(request.budgets))))
                advance()
        report = ApproxReport(model=request.model.ref, text=request.data.dataset or str(request.data.text),
                              seq_len=loaded.windows.shape[1], budgets=request.budgets,
                              bidirectional=sorted(BIDIRECTIONAL), layers=results)
        plot = approx_figure(report, staging / "approx.png")
        report.seconds = time.perf_counter() - started
        files = write_json(report, staging, "approx") + [plot]
    return report, [request.output / f.name for f in files]
