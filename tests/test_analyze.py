"""attnsurg analyze: finds planted ranks and sparsity, writes plots and a report that validates."""

import json
import math

import jsonschema
import matplotlib.image
import pytest
import torch
from typer.testing import CliRunner

from attnsurg.analyze.report import AnalysisReport
from attnsurg.sparsity import entropy_ratio, sink_mass, top_mass
from attnsurg.heads import attention_probabilities
from attnsurg.analyze.spectra import energy_rank, frequency_energy, moment_spectrum
from attnsurg.cli import app

from conftest import build_tiny

PLOTS = ("weight_spectra", "activation_spectra", "attention_spectra", "ranks", "rope_energy", "sparsity")


def test_energy_rank_counts_the_strongest_values_that_hold_the_share():
    values = torch.tensor([2.0, 1.0, 0.0, 0.0])  # energies 4 and 1
    assert energy_rank(values, 0.8) == 1 and energy_rank(values, 0.81) == 2 and energy_rank(values, 0.9) == 2
    assert energy_rank(torch.zeros(3), 0.9) == 0


def test_moment_spectrum_is_the_singular_values_of_the_tokens_over_their_count():
    x = torch.randn(500, 12, dtype=torch.float64)
    expected = torch.linalg.svdvals(x) / math.sqrt(len(x))
    torch.testing.assert_close(moment_spectrum(x.T @ x / len(x)), expected)


def test_frequency_energy_pairs_dims_half_a_head_apart():
    moment = torch.zeros(8, 8, dtype=torch.float64)
    moment[1, 1], moment[5, 5], moment[2, 2] = 3.0, 1.0, 2.0
    assert frequency_energy(moment).tolist() == [0.0, 4.0, 2.0, 0.0]


def test_one_key_attention_is_found_sparse_and_a_sink():
    """Every query attends to the first key alone: all its mass in the top 1%, on the sink, entropy zero."""
    length, d = 200, 8
    query = torch.zeros(1, length, d)
    query[..., 0] = 100.0
    key = torch.zeros(1, length, d)
    key[:, 0, 0] = 1.0
    p = attention_probabilities(query, key, 1.0)
    assert torch.allclose(top_mass(p, (0.01,)), torch.ones(1, 1)) and torch.allclose(sink_mass(p), torch.ones(1))
    assert entropy_ratio(p).item() < 1e-6


def test_uniform_attention_is_found_dense():
    """Queries of zeros attend uniformly: the top share of keys holds that share of the mass, entropy one."""
    length = 400
    p = attention_probabilities(torch.zeros(2, length, 4), torch.randn(2, length, 4), 1.0)
    masses = top_mass(p, (0.05, 0.1))
    rows = torch.arange(16, length + 1).double()
    expected = [float((torch.ceil(rows * s) / rows).mean()) for s in (0.05, 0.1)]
    torch.testing.assert_close(masses, torch.tensor([expected, expected]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy_ratio(p), torch.ones(2, dtype=torch.float64))
    assert sink_mass(p)[0] == pytest.approx(float((1 / rows).mean()), rel=1e-5)


def planted_checkpoint(path, tokenizer, key_rank: int, value_rank: int):
    """A tiny Llama whose every KV head's key and value projections have exactly the given ranks."""
    model = build_tiny("llama", len(tokenizer), num_key_value_heads=2)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            d, hidden = attention.head_dim, attention.k_proj.weight.shape[1]
            for projection, rank in ((attention.k_proj, key_rank), (attention.v_proj, value_rank)):
                heads = [torch.randn(d, rank, generator=generator) @ torch.randn(rank, hidden, generator=generator)
                         for _ in range(projection.weight.shape[0] // d)]
                projection.weight.copy_(torch.cat(heads) / hidden**0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model



def test_the_report_finds_planted_ranks_and_writes_plots_and_json_that_validate(tokenizer, corpus_file, tmp_path):
    planted_checkpoint(tmp_path / "model", tokenizer, key_rank=3, value_rank=5)
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["analyze", str(tmp_path / "model"), "--text", str(corpus_file), "--tokens", "512",
                                      "--seq-len", "128", "-o", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "analysis.json").read_text())
    jsonschema.validate(record, json.loads((out / "analysis.schema.json").read_text()))
    report = AnalysisReport.model_validate(record)
    assert len(report.layers) == 2 and report.tokens == 512
    everything = 1 - 1e-9
    for layer in report.layers:
        assert [energy_rank(torch.tensor(s.values), everything) for s in layer.keys_pre_rope] == [3, 3]
        assert [energy_rank(torch.tensor(s.values), everything) for s in layer.values] == [5, 5]
        assert all(s.rank99 <= 3 for s in layer.keys_pre_rope)
        assert [energy_rank(torch.tensor(s.values), everything) for s in layer.weights["k"].per_kv_head] == [3, 3]
        assert energy_rank(torch.tensor(layer.kv_joint.values), everything) == 2 * (3 + 5)
        assert len(layer.heads) == 4 and all(0 <= h.sink <= 1 and 0 < h.top["5%"] <= 1 for h in layer.heads)
        assert sum(layer.query_frequency_energy) == pytest.approx(1.0)
    for name in PLOTS:
        assert matplotlib.image.imread(out / f"{name}.png").shape[0] > 100
    assert "K,V joint r99" in result.output


def test_layers_restrict_the_report_and_bad_ones_are_one_line(tiny_checkpoints, corpus_file, tmp_path):
    common = ["analyze", str(tiny_checkpoints["qwen2"]), "--text", str(corpus_file), "--tokens", "256", "--seq-len", "64"]
    result = CliRunner().invoke(app, [*common, "--layers", "1", "-o", str(tmp_path / "one"), "--json"])
    assert result.exit_code == 0, result.output
    assert [layer["layer"] for layer in json.loads(result.stdout)["layers"]] == [1]
    bad = CliRunner().invoke(app, [*common, "--layers", "7", "-o", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "layers 0-1" in bad.output and not (tmp_path / "bad").exists()
    again = CliRunner().invoke(app, [*common, "--layers", "1", "-o", str(tmp_path / "one")])
    assert again.exit_code == 2 and "--overwrite" in again.output
    backwards = CliRunner().invoke(app, [*common, "--layers", "1-0", "-o", str(tmp_path / "backwards")])
    assert backwards.exit_code == 2 and "--layers '1-0'" in backwards.output


# ------------------------------------------------------------------------------------ analyze approx
def random_heads(scale: float, length: int = 96, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(length, d, generator=g, dtype=torch.float64) * s for s in (scale, scale, 1.0)]


@pytest.mark.parametrize("family", ["low rank", "lsh", "top-k", "loki"])
def test_causal_families_are_exact_at_full_budget(family):
    from attnsurg.analyze.approx import FAMILIES, exact_attention, relative_error

    q, k, v = random_heads(1.5)
    exact = exact_attention(q, k, v, 0.25)
    assert relative_error(FAMILIES[family](q, k, v, 0.25, 1.0, torch.Generator().manual_seed(0)), exact) < 1e-10


def test_nystrom_is_exact_with_every_token_a_landmark_and_the_exact_inverse():
    from attnsurg.analyze.approx import bidirectional_attention, nystrom, relative_error

    q, k, v = random_heads(0.5)
    reference = bidirectional_attention(q, k, v, 0.25)
    assert relative_error(nystrom(q, k, v, 0.25, 1.0, iterations=None), reference) < 1e-8
    assert relative_error(nystrom(q, k, v, 0.25, 1.0), reference) < 0.05  # six iterations of the inverse


@pytest.mark.parametrize("family", ["low rank", "nystrom", "lsh", "top-k", "loki"])
def test_error_falls_as_the_budget_grows(family):
    from attnsurg.analyze.approx import family_errors

    q, k, v = random_heads(1.0 if family == "nystrom" else 1.5)
    errors = family_errors(q[None], k[None], v[None], 0.25, (1 / 16, 1 / 4, 1.0))[family]
    assert errors[0] > errors[1] > errors[2], errors


def test_performer_error_falls_with_more_random_features_where_attention_is_smooth():
    """Random features are unbiased, not exact: their error shrinks like 1/sqrt(m) (averaged over draws)."""
    from attnsurg.analyze.approx import exact_attention, performer, relative_error

    q, k, v = random_heads(0.3)
    exact = exact_attention(q, k, v, 0.25)

    def mean_error(budget: float) -> float:
        return sum(relative_error(performer(q, k, v, 0.25, budget, torch.Generator().manual_seed(s)), exact)
                   for s in range(5)) / 5

    few, many = mean_error(1 / 8), mean_error(8.0)
    assert many < few / 3, (few, many)


def test_approx_command_writes_a_report_that_validates(tiny_checkpoints, corpus_file, tmp_path):
    out = tmp_path / "approx"
    result = CliRunner().invoke(app, ["analyze", "approx", str(tiny_checkpoints["llama-gqa"]), "--text", str(corpus_file),
                                      "--seq-len", "64", "--budgets", "1/8,0.5", "-o", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "approx.json").read_text())
    jsonschema.validate(record, json.loads((out / "approx.schema.json").read_text()))
    assert record["budgets"] == [0.125, 0.5] and [layer["index"] for layer in record["layers"]] == [0, 1]
    every = CliRunner().invoke(app, ["analyze", "approx", str(tiny_checkpoints["llama-gqa"]), "--text", str(corpus_file),
                                     "--seq-len", "32", "--budgets", "0.5", "--layers", "all", "-o", str(tmp_path / "all"),
                                     "--json"])
    assert every.exit_code == 0 and [layer["index"] for layer in json.loads(every.stdout)["layers"]] == [0, 1]
    assert set(record["layers"][0]["errors"]) == {"low rank", "nystrom", "performer", "lsh", "top-k", "loki"}
    assert matplotlib.image.imread(out / "approx.png").shape[0] > 100
    bad = CliRunner().invoke(app, ["analyze", "approx", str(tiny_checkpoints["llama-gqa"]), "--budgets", "2",
                                   "-o", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "(0, 1]" in bad.output and not (tmp_path / "bad").exists()


def test_a_sliding_window_bounds_what_each_query_sees_and_how_its_share_is_counted():
    q = k = torch.zeros(1, 40, 4)  # uniform attention over whatever each query sees
    p = attention_probabilities(q, k, 1.0, window=8)
    assert (p[0, 39, :32] == 0).all() and torch.allclose(p[0, 39, 32:], torch.full((8,), 1 / 8))
    assert top_mass(p, (0.25,), min_context=8, window=8).item() == pytest.approx(0.25)  # 2 of 8 keys, not of 40
    assert entropy_ratio(p, min_context=8, window=8).item() == pytest.approx(1.0)
    scores = torch.arange(40.0).expand(40, 40)[None]  # a scorer preferring the oldest keys picks only visible ones
    assert top_mass(p, (0.25,), min_context=8, scores=-scores, window=8).item() == pytest.approx(0.25)
