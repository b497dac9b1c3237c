"""The report's figures (matplotlib, written as PNG): spectra on log scales, ranks per layer, RoPE energy per
frequency and attention sparsity as layer x head heatmaps."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

from attnsurg.analyze.report import AnalysisReport, Spectrum  # noqa: E402


def normalized(spectrum: Spectrum) -> np.ndarray:
    values = np.asarray(spectrum.values)
    return values / values[0] if len(values) and values[0] > 0 else values


def spectra_panel(axis, report: AnalysisReport, pick, title: str) -> None:
    """One line per layer (coloured by depth) of the spectra ``pick(layer)`` returns, averaged over heads."""
    colours = plt.cm.viridis(np.linspace(0, 1, max(len(report.layers), 2)))
    for colour, layer in zip(colours, report.layers, strict=False):
        spectra = [normalized(s) for s in pick(layer)]
        width = min(len(s) for s in spectra)
        axis.semilogy(np.arange(1, width + 1), np.mean([s[:width] for s in spectra], axis=0), color=colour, lw=1)
    axis.set_title(title)
    axis.set_xlabel("index")
    axis.set_ylabel("singular value / largest")
    axis.grid(True, which="both", alpha=0.3)


def depth_legend(figure, report: AnalysisReport) -> None:
    mapper = plt.cm.ScalarMappable(cmap="viridis", norm=plt.Normalize(report.layers[0].index, report.layers[-1].index))
    figure.colorbar(mapper, ax=figure.axes, label="layer")


def weight_spectra_figure(report: AnalysisReport, path: Path) -> Path:
    figure, axes = plt.subplots(1, 4, figsize=(18, 4.2), constrained_layout=True)
    for axis, name in zip(axes, "qkvo", strict=True):
        spectra_panel(axis, report, lambda layer, n=name: layer.weights[n].per_kv_head, f"W_{name} per KV head")
    depth_legend(figure, report)
    figure.suptitle(f"{report.model}: weight spectra")
    return save(figure, path)


def activation_spectra_figure(report: AnalysisReport, path: Path) -> Path:
    figure, axes = plt.subplots(1, 4, figsize=(18, 4.2), constrained_layout=True)
    panels = [(lambda layer: layer.keys_pre_rope, "K before RoPE, per KV head"),
              (lambda layer: layer.keys_post_rope, "K after RoPE, per KV head"),
              (lambda layer: layer.values, "V, per KV head"),
              (lambda layer: [layer.kv_joint], "K and V of all heads together")]
    for axis, (pick, title) in zip(axes, panels, strict=True):
        spectra_panel(axis, report, pick, title)
    depth_legend(figure, report)
    figure.suptitle(f"{report.model}: activation spectra over {report.tokens:,} tokens of {report.text}")
    return save(figure, path)


def attention_spectra_figure(report: AnalysisReport, path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    spectra_panel(axis, report, lambda layer: [h.attention for h in layer.heads],
                  f"attention matrices ({report.seq_len} tokens), mean over heads")
    depth_legend(figure, report)
    return save(figure, path)


def ranks_figure(report: AnalysisReport, path: Path) -> Path:
    """Per layer, the rank holding 90% and 99% of the energy, as a share of the full size."""
    layers = [layer.index for layer in report.layers]
    series = {
        "W_k": lambda layer: layer.weights["k"].per_kv_head,
        "K before RoPE": lambda layer: layer.keys_pre_rope,
        "K after RoPE": lambda layer: layer.keys_post_rope,
        "V": lambda layer: layer.values,
        "K, V joint": lambda layer: [layer.kv_joint],
        "attention": lambda layer: [h.attention for h in layer.heads],
    }
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.5), constrained_layout=True, sharey=True)
    for axis, share in zip(axes, ("rank90", "rank99"), strict=True):
        for label, pick in series.items():
            axis.plot(layers, [np.mean([getattr(s, share) / s.size for s in pick(layer)]) for layer in report.layers],
                      marker="o", ms=3, label=label)
        axis.set_title(f"rank holding {share[-2:]}% of the energy")
        axis.set_xlabel("layer")
        axis.set_ylabel("rank / full size")
        axis.set_ylim(0, 1.02)
        axis.grid(True, alpha=0.3)
    axes[1].legend(fontsize=8)
    return save(figure, path)


def rope_energy_figure(report: AnalysisReport, path: Path) -> Path:
    """Layer x RoPE frequency: the keys' (mean over KV heads) and queries' share of energy, log colour."""
    keys = np.array([np.mean(layer.key_frequency_energy, axis=0) for layer in report.layers])
    queries = np.array([layer.query_frequency_energy for layer in report.layers])
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.5), constrained_layout=True)
    for axis, data, title in ((axes[0], keys, "keys"), (axes[1], queries, "queries")):
        image = axis.imshow(np.log10(np.maximum(data, 1e-8)), aspect="auto", cmap="magma")
        axis.set_title(f"{title}: share of energy per RoPE frequency (log10)")
        axis.set_xlabel("frequency index (0 = fastest rotation)")
        label_layers(axis, report)
        figure.colorbar(image, ax=axis)
    return save(figure, path)


def sparsity_figure(report: AnalysisReport, path: Path) -> Path:
    """Layer x head heatmaps: mass in the top 5% of keys, on the first token, and the entropy ratio."""
    grids = [("attention mass in the top 5% of keys", lambda h: h.top["5%"]),
             ("attention mass on the first token (sink)", lambda h: h.sink),
             ("entropy / log(context)", lambda h: h.entropy)]
    figure, axes = plt.subplots(1, 3, figsize=(18, 4.8), constrained_layout=True)
    for axis, (title, pick) in zip(axes, grids, strict=True):
        data = np.array([[pick(h) for h in layer.heads] for layer in report.layers])
        image = axis.imshow(data, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        axis.set_title(title)
        axis.set_xlabel("query head")
        label_layers(axis, report)
        figure.colorbar(image, ax=axis)
    figure.suptitle(f"{report.model}: attention sparsity on {report.attention_windows} window(s) of {report.seq_len} tokens")
    return save(figure, path)


def label_layers(axis, report: AnalysisReport) -> None:
    """Heatmap rows are the analysed layers in order, labelled with their indices (they need not be contiguous)."""
    indices = [layer.index for layer in report.layers]
    step = max(1, len(indices) // 12)
    axis.set_yticks(range(0, len(indices), step), labels=[str(i) for i in indices[::step]])
    axis.set_ylabel("layer")


def save(figure, path: Path) -> Path:
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_plots(report: AnalysisReport, directory: Path) -> list[Path]:
    return [
        weight_spectra_figure(report, directory / "weight_spectra.png"),
        activation_spectra_figure(report, directory / "activation_spectra.png"),
        attention_spectra_figure(report, directory / "attention_spectra.png"),
        ranks_figure(report, directory / "ranks.png"),
        rope_energy_figure(report, directory / "rope_energy.png"),
        sparsity_figure(report, directory / "sparsity.png"),
    ]


def approx_figure(report, path: Path) -> Path:
    """One panel per layer: each family's relative output error against the budget, log-log."""
    count = len(report.layers)
    figure, axes = plt.subplots(1, count, figsize=(5.5 * count, 4.5), constrained_layout=True, squeeze=False)
    for axis, layer in zip(axes[0], report.layers, strict=True):
        for family, errors in layer.errors.items():
            label = family + (" (bidirectional)" if family in report.bidirectional else "")
            axis.loglog(report.budgets, np.maximum(errors, 1e-6), marker="o", label=label)
        axis.set_title(f"layer {layer.index}")
        axis.set_xlabel("budget (share of exact attention's cost)")
        axis.set_ylabel("||O~ - O|| / ||O||")
        axis.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    figure.suptitle(f"{report.model}: attention approximations on {report.seq_len} tokens of {report.text}")
    return save(figure, path)


def plan_figure(report, path: Path) -> Path:
    """One panel per method: the predicted perplexity ratio against the budget, the anchors it is fitted to, the
    target and (with --verify) the chosen budget's measured ratio."""
    count = len(report.methods)
    figure, axes = plt.subplots(1, count, figsize=(5 * count, 4.2), constrained_layout=True, squeeze=False)
    for axis, method in zip(axes[0], report.methods, strict=True):
        axis.semilogy(method.budgets, method.predicted, marker=".", label="predicted")
        axis.semilogy([a.budget for a in method.anchors], [a.ratio for a in method.anchors], "s", label="anchors (measured)")
        if method.floor is not None:
            axis.semilogy([method.floor.budget], [method.floor.ratio], "v", label="floor (measured)")
        if method.measured_ratio is not None:
            axis.semilogy([method.chosen], [method.measured_ratio], "*", markersize=12, label="chosen (measured)")
        axis.axhline(report.target_ratio, color="grey", linestyle="--", label=f"target x{report.target_ratio:g}")
        axis.set_title(method.method)
        axis.set_xlabel("budget")
        axis.set_ylabel("perplexity ratio to the source")
        axis.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("x%.3g"))
        axis.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("x%.3g"))
        axis.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    texts = ", ".join(report.ppl_source)
    figure.suptitle(f"{report.model}: planned budgets (worst ratio over {report.eval_tokens} tokens of each of {texts})")
    return save(figure, path)
