"""``attnsurg analyze plan``: the error model, the proxies' monotonicity, and the command's files."""

import json
import math

import jsonschema
import pytest
import torch
from typer.testing import CliRunner

from attnsurg.analyze.plan import ErrorModel, smallest_within
from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import attention_layers, input_statistics
from attnsurg.cli import app
from attnsurg.io.recipe_file import parse_recipe
from attnsurg.methods.lowrank import lowrank_settings
from attnsurg.methods.planning import PlanContext, PlannedMethod, planned_methods
from attnsurg.requests import PlanRequest

from conftest import build_tiny, with_mean_direction


def test_error_model_passes_through_both_anchors_and_grows_with_the_proxy():
    model = ErrorModel.through((0.2, 1.1), (0.8, 1.9))
    assert model.ratio(0.2) == pytest.approx(1.1) and model.ratio(0.8) == pytest.approx(1.9)
    assert model.ratio(0.0) == 1.0 and model.ratio(0.1) < model.ratio(0.5) < model.ratio(1.0)
    flat = ErrorModel.through((0.3, 1.2), (0.3, 1.2))  # one point's worth: proportional through it
    steep = ErrorModel.through((0.01, 1.0), (0.02, 3.0))  # an anchor at x1: the power is enormous
    assert math.isfinite(steep.ratio(5.0)) and steep.ratio(5.0) > 1e20
    inverted = ErrorModel.through((0.2, 1.01), (0.1, 1.5))  # the larger proxy measured better: proportional
    assert inverted.power == 1.0 and inverted.ratio(0.0) == 1.0 and inverted.ratio(0.3) > 1.0
    assert flat.power == 1.0 and flat.ratio(0.3) == pytest.approx(1.2)
    floored = ErrorModel.through((0.2, 1.2), (0.8, 2.0), floor=1.1)  # a method not exact at proxy 0
    assert floored.ratio(0.0) == pytest.approx(1.1) and floored.ratio(0.2) == pytest.approx(1.2)
    assert floored.ratio(0.8) == pytest.approx(2.0) and floored.ratio(0.1) < floored.ratio(0.2)


def test_the_smallest_budget_within_the_target_leaves_no_larger_budget_above_it():
    budgets = (0.25, 0.5, 0.75, 1.0)
    assert smallest_within(budgets, [1.5, 1.2, 1.1, 1.0], 1.25) == 0.5
    assert smallest_within(budgets, [1.1, 1.4, 1.1, 1.0], 1.25) == 0.75  # not past a larger budget that fails
    assert smallest_within(budgets, [2.0, 1.8, 1.6, 1.5], 1.25) is None


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    model = with_mean_direction(build_tiny("llama", 384, num_key_value_heads=2))
    family = family_for_surgery("llama")
    windows = torch.randint(0, 384, (4, 64), generator=torch.Generator().manual_seed(1))
    attentions = attention_layers(model, family)
    stats = input_statistics(model, attentions + [a.o_proj for a in attentions], windows)
    request = PlanRequest(model={"ref": "tiny"}, output=tmp_path_factory.mktemp("plan") / "out")
    return PlanContext(request, model, None, inspect_config(model.config), family, torch.device("cpu"), windows,
                       list(zip(stats[:2], stats[2:])), [])


@pytest.mark.parametrize("method", ["svdllm", "svdllm-allocate", "loki", "mla", "tucker", "cp"])
def test_each_proxy_falls_as_the_budget_grows_and_vanishes_at_full_budget(context, method):
    budgets = (0.25, 0.5, 0.75, 1.0)
    per_layer = planned_methods()[method].proxy(context, budgets)
    assert len(per_layer) == len(budgets) and all(len(row) == 2 for row in per_layer)
    totals = [sum(row) for row in per_layer]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1], totals
    if method in ("tucker", "cp"):  # a ratio of 1 buys ranks below full (the factors cost parameters too)
        assert totals[-1] < totals[0] / 4, totals
        return
    # loki and the low-rank latent are exact at full budget; the native MLA format fits its norm channel
    assert totals[-1] < (1e-2 if method == "mla" else 1e-9), totals


def test_the_linear_proxy_falls_as_the_window_grows_and_vanishes_at_the_whole_window(context):
    per_layer = planned_methods()["linear"].proxy(context, (4, 16, 32, 64))
    totals = [sum(row) for row in per_layer]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[2] > 0 and totals[-1] == 0, totals


def test_loki_variance_at_full_variance_selects_the_true_top_keys(context):
    """At variance 1 the scores use every principal coordinate, so they pick the truly strongest keys and miss
    nothing against them; fewer coordinates miss more."""
    from attnsurg.methods.loki import LOKI_VARIANCE_TOP_K

    by_variance = [sum(row) for row in planned_methods()["loki-variance"].proxy(context, (0.3, 0.6, 1.0))]
    assert by_variance[0] > by_variance[1] > 0 and abs(by_variance[-1]) < 1e-3 * by_variance[0], by_variance
    settings = planned_methods()["loki-variance"].settings(0.9, context.anatomy)
    assert settings.variance == 0.9 and settings.rank is None and settings.top_k == LOKI_VARIANCE_TOP_K


def test_plan_writes_a_report_with_its_schema_a_plot_and_runnable_recipes(tiny_checkpoints, corpus_file, tmp_path):
    out = tmp_path / "plan"
    args = ["analyze", "plan", str(tiny_checkpoints["llama-gqa"]), "--methods", "svdllm,loki,loki-variance,tucker", "--calib-text", str(corpus_file),
            "--calib-tokens", "512", "--calib-seq-len", "64", "--eval-tokens", "256", "--target-ratio", "1.5",
            "--eval-domains", "none", "--verify", "-o", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "plan.json").read_text())
    jsonschema.validate(report, json.loads((out / "plan.schema.json").read_text()))
    assert (out / "plan.png").stat().st_size > 0
    for method in report["methods"]:
        anchors = method["anchors"]  # the defaults, and the first choice when it was neither
        assert len(anchors) in (2, 3) and all(math.isfinite(a["ratio"]) for a in anchors)
        assert sum(a["fitted"] for a in anchors) == 2 and (len(anchors) == 2 or anchors[2]["predicted"] is not None)
        assert method["chosen"] is not None and method["measured_ratio"] is not None
        recipe = parse_recipe((out / f"{method['method']}.yaml").read_text())
        knob = {"loki": "top_k", "loki-variance": "variance"}.get(method["method"], "ratio")
        assert getattr(recipe.surgery, knob) == method["chosen"]
        floor = method["floor"]  # only loki-variance is not exact where its proxy vanishes
        assert (floor is not None) == (method["method"] == "loki-variance")
        if floor is not None:  # the fitted model starts from the measured floor
            assert floor["budget"] == 1.0 and method["predicted"][-1] >= floor["ratio"] - 1e-9


def test_unknown_methods_are_one_line_and_exit_2(tiny_checkpoints, tmp_path):
    result = CliRunner().invoke(app, ["analyze", "plan", str(tiny_checkpoints["llama-gqa"]), "--methods", "svdllm,magic",
                                      "-o", str(tmp_path / "p")])
    assert result.exit_code == 2 and "plan any of svd, asvd, svdllm, svd-allocate" in result.output
    assert not (tmp_path / "p").exists()


def test_allocated_ranks_lose_no_more_energy_than_uniform_ones_at_the_same_cache(context):
    budgets = (0.25, 0.5)
    uniform = [sum(row) for row in planned_methods()["svdllm"].proxy(context, budgets)]
    allocated = [sum(row) for row in planned_methods()["svdllm-allocate"].proxy(context, budgets)]
    assert all(a <= u + 1e-9 for a, u in zip(allocated, uniform)), (allocated, uniform)
    assert planned_methods()["svdllm-allocate"].settings(0.5, context.anatomy).allocate


def test_the_target_holds_for_the_worst_of_the_scored_texts(tiny_checkpoints, corpus_file, tmp_path):
    out = tmp_path / "plan"
    args = ["analyze", "plan", str(tiny_checkpoints["llama-gqa"]), "--methods", "svdllm", "--calib-text", str(corpus_file),
            "--calib-tokens", "256", "--calib-seq-len", "64", "--eval-tokens", "128", "--target-ratio", "1.5",
            "--eval-domains", "c4-sample,code-sample", "--verify", "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "plan.json").read_text())
    assert list(report["ppl_source"]) == [corpus_file.name, "c4-sample", "code-sample"]
    (method,) = report["methods"]
    for anchor in method["anchors"]:
        assert set(anchor["ratios"]) == set(report["ppl_source"]) and anchor["ratio"] == max(anchor["ratios"].values())
    assert method["measured_ratio"] == max(method["measured_ratios"].values())
    assert "worst of" in result.output and "at worst over 128 tokens" in (out / "svdllm.yaml").read_text()


def test_the_first_choice_is_converted_and_the_model_refitted_through_it(context, monkeypatch):
    """A true curve the power law through the default anchors (0.25, 0.5) extrapolates badly: the first choice
    is converted, the model is refitted through it and the default anchor across the target, and the final
    prediction lands nearer the truth than the first one did."""
    import dataclasses

    from attnsurg.analyze import plan

    def true_ratio(budget: float) -> float:
        return math.exp(0.3 * (1 - budget) + 6 * (1 - budget) ** 4)

    converted = []

    def fake_ratios(ctx, method, budget):
        converted.append(budget)
        return {"text": true_ratio(budget)}

    monkeypatch.setattr(plan, "measured_ratios", fake_ratios)
    budgets = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)
    method = PlannedMethod("synthetic", budgets, (0.25, 0.5), lowrank_settings("svdllm"),
                                lambda ctx, bs: [[1 - b, 0.0] for b in bs])
    ctx = dataclasses.replace(context, request=context.request.model_copy(update={"target_ratio": 1.3, "verify": True}))
    report, recipe = plan.plan_method(ctx, method)
    first, nearer = report.anchors[0], report.anchors[2]
    assert len(report.anchors) == 3 and nearer.predicted is not None and nearer.fitted
    assert sum(a.fitted for a in report.anchors) == 2 and not first.fitted  # 0.25 is the far side of 0.5
    assert abs(report.predicted_ratio / true_ratio(report.chosen) - 1) < abs(nearer.predicted / nearer.ratio - 1)
    assert report.measured_ratio == pytest.approx(true_ratio(report.chosen)) and recipe is not None
    assert report.chosen_is_anchor and converted.count(report.chosen) == 1  # the refit kept it: measured once
