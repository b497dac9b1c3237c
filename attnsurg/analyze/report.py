"""The analysis report: its JSON form (pydantic models, so the file has a schema) and where it is written."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

STORED_VALUES = 128  # singular values kept per spectrum in the JSON (ranks are computed on all of them)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Spectrum(Strict):
    """Singular values, strongest first (the first STORED_VALUES), and the ranks holding 90% / 99% of the energy."""

    size: int = Field(description="How many singular values there are in all.")
    values: list[float] = Field(description="The strongest singular values, descending.")
    rank90: int
    rank99: int


class ProjectionSpectra(Strict):
    """A projection's weight spectrum, whole and per KV head (for q and o: the query heads of each KV group)."""

    whole: Spectrum
    per_kv_head: list[Spectrum]


class HeadSparsity(Strict):
    """One query head's attention on the analysed windows."""

    top: dict[str, float] = Field(description="Mean attention mass in each query's strongest 1%, 5%, 10% of keys.")
    sink: float = Field(description="Mean attention mass on the first token.")
    entropy: float = Field(description="Mean attention entropy over log(context): 1 uniform, 0 one key.")
    attention: Spectrum = Field(description="Spectrum of the attention matrix on the first window.")


class LayerAnalysis(Strict):
    index: int
    weights: dict[str, ProjectionSpectra] = Field(description="q, k, v, o weight spectra.")
    keys_pre_rope: list[Spectrum] = Field(description="Per KV head, the keys' spectrum before RoPE.")
    keys_post_rope: list[Spectrum] = Field(description="Per KV head, the keys' spectrum after RoPE.")
    values: list[Spectrum] = Field(description="Per KV head, the values' spectrum.")
    kv_joint: Spectrum = Field(description="Keys (before RoPE) and values of all KV heads together: the latent an "
                                           "MLA conversion compresses them into.")
    key_frequency_energy: list[list[float]] = Field(description="Per KV head, the keys' share of energy per RoPE "
                                                                "frequency (highest frequency first).")
    query_frequency_energy: list[float] = Field(description="The queries' share of energy per RoPE frequency, "
                                                            "over all query heads.")
    heads: list[HeadSparsity]


class AnalysisReport(Strict):
    """``attnsurg analyze``: one model's attention on real text."""

    model: str
    text: str
    tokens: int = Field(description="Tokens the activation spectra are measured on.")
    seq_len: int
    attention_windows: int = Field(description="Windows the attention matrices (sparsity, spectra) come from.")
    head_dim: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float | None
    layers: list[LayerAnalysis]
    seconds: float = 0.0


class LayerApprox(Strict):
    index: int
    errors: dict[str, list[float]] = Field(description="Per family, the mean over heads of ||O~ - O|| / ||O|| at "
                                                        "each budget.")


class ApproxReport(Strict):
    """``attnsurg analyze approx``: each approximation family's attention-output error at equal budgets."""

    model: str
    text: str
    seq_len: int
    budgets: list[float] = Field(description="Shares of exact attention's cost.")
    bidirectional: list[str] = Field(description="Families measured against bidirectional attention (no causal form).")
    layers: list[LayerApprox]
    seconds: float = 0.0


class Anchor(Strict):
    """A real conversion the error model is fitted to."""

    budget: float
    proxy: float = Field(description="The summed per-layer error proxy at this budget.")
    ratio: float = Field(description="Measured perplexity ratio to the source, the worst over the scored texts.")
    ratios: dict[str, float] = Field(default_factory=dict, description="The measured ratio on each scored text.")
    predicted: float | None = Field(None, description="For the budget first chosen from the default anchors, then "
                                                      "converted: the ratio predicted there before it was measured.")
    fitted: bool = Field(True, description="Whether the final error model goes through this anchor.")


class MethodPlanReport(Strict):
    """One method's plan: its proxy and predicted ratio at every candidate budget, the anchors, the error model
    log(ratio) = log(floor) + scale * proxy^power, and the chosen budget (None: no candidate stays within the
    target)."""

    method: str
    budgets: list[float]
    proxies: list[float] = Field(description="Per budget, the per-layer error proxy summed over layers.")
    layer_proxies: list[list[float]] = Field(description="Per budget, the error proxy of each layer.")
    predicted: list[float] = Field(description="Per budget, the predicted perplexity ratio.")
    anchors: list[Anchor]
    floor: Anchor | None = Field(None, description="Where the proxy is 0 but the method is not exact, converted "
                                                   "for real: the error model's floor (none: x1).")
    scale: float
    power: float
    chosen: float | None
    predicted_ratio: float | None = None
    measured_ratio: float | None = Field(None, description="The chosen budget converted and scored (--verify), the "
                                                           "worst over the scored texts.")
    measured_ratios: dict[str, float] | None = Field(None, description="The chosen budget's ratio on each scored text.")
    relative_difference: float | None = Field(None, description="measured / predicted - 1.")
    chosen_is_anchor: bool | None = Field(None, description="The chosen budget is an anchor: its measured ratio is "
                                                            "the anchor's, which the error model passes through.")


class PlanReport(Strict):
    """``attnsurg analyze plan``: per method, the smallest budget predicted to stay within the target ratio."""

    model: str
    text: str
    eval_tokens: int = Field(description="Tokens of each scored text's eval part every ratio is measured on.")
    target_ratio: float = Field(description="Largest ratio allowed on the worst of the scored texts.")
    ppl_source: dict[str, float] = Field(description="Per scored text (the calibration text's eval part first), the "
                                                     "source's perplexity.")
    methods: list[MethodPlanReport]
    seconds: float = 0.0


def write_json(model: BaseModel, directory: Path, name: str) -> list[Path]:
    """A report and its JSON schema, side by side (``name.json``, ``name.schema.json``)."""
    report_path, schema_path = directory / f"{name}.json", directory / f"{name}.schema.json"
    report_path.write_text(model.model_dump_json(indent=1), encoding="utf-8")
    schema_path.write_text(json.dumps(type(model).model_json_schema(), indent=1), encoding="utf-8")
    return [report_path, schema_path]
