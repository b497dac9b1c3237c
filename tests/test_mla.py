import json
from dataclasses import replace

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from typer.testing import CliRunner

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import attention_inputs, causal_mask, input_statistics, second_moment
from attnsurg.cli import app
from attnsurg import api
from attnsurg.errors import UserError
from attnsurg.linalg import augmented
from attnsurg.methods import mla
from attnsurg.methods.mla.assemble import deepseek_config
from attnsurg.methods.mla.conversion import convert
from attnsurg.methods.mla.fit import fit_layer
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.methods.mla.refine import Refinement, refine_layer, sampled_output
from attnsurg.methods.mla.engines import engine_problems
from attnsurg.methods.mla.plan import split_reason
from attnsurg.methods.mla.report import engine_note
from attnsurg.requests import Calibration, TextData

from conftest import build_tiny, with_mean_direction

LLAMA = family_for_surgery("llama")
QWEN2 = family_for_surgery("qwen2")


def converted_error(model, plan, ids, weighted=True, refine_steps=0, family="llama", received=False) -> float:
    windows = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    mla = convert(model, family_for_surgery(family), windows, plan, weighted, Refinement(steps=refine_steps),
                  received=received).model
    with torch.no_grad():
        return (mla(ids).logits - model(ids).logits).abs().max().item()


def test_full_budget_is_exact_when_one_kv_head_holds_all_rope():
    """With G = 1 the shared RoPE key loses nothing, so the full budget reproduces the logits."""
    model = build_tiny("llama", 384, num_key_value_heads=1)
    plan = plan_mla(inspect_config(model.config), kv_budget=1.0, format="exact")
    assert plan.kv_rank == plan.full_rank and plan.rope_dim == 16
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0))
    assert converted_error(model, plan, ids) < 1e-4
    assert converted_error(model, plan, ids, refine_steps=10) < 1e-4  # refinement never leaves an exact fit
    assert converted_error(model, plan, ids, received=True) < 1e-4  # tokens weighted by the attention they receive


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_cache_fitted_on_received_attention_loses_less_where_the_attention_is(family):
    """Weighting the tokens by the attention they receive lowers the layer's output error, which is that
    attention's mix of the values, below the uniform fit's on the same windows; monotone in the budget."""
    model = build_tiny(family, 384, num_key_value_heads=2)
    anatomy = inspect_config(model.config)
    windows = torch.randint(0, 384, (4, 64), generator=torch.Generator().manual_seed(1))
    attentions = [layer.self_attn for layer in model.model.layers]
    stats = input_statistics(model, attentions, windows, received=attentions)
    inputs = attention_inputs(model, family_for_surgery(family), windows)
    rotary = model.model.rotary_emb
    positions = torch.arange(64)[None]

    def error(budget: float, received: bool) -> float:
        plan = plan_mla(anatomy, kv_budget=budget, format="exact")
        config = deepseek_config(model, plan, rotary.inv_freq)
        rope = DeepseekV3RotaryEmbedding(config)(inputs[0][:1], positions)
        total = 0.0
        for index, (attention, s, x) in enumerate(zip(attentions, stats, inputs)):
            with torch.no_grad():
                target = attention(hidden_states=x, position_embeddings=rotary(x, positions), attention_mask=causal_mask(64))[0]
                w = fit_layer(attention, s.sigma, plan, True, s.sigma_first, rotary.inv_freq, s.sigma_received if received else None)
                out = sampled_output(mla.refine.mla_attention(config, index, w, attention.o_proj.weight), x, rope, torch.arange(64))
            total += float((out - target).pow(2).sum() / target.pow(2).sum())
        return total / len(attentions)

    received = [error(budget, True) for budget in (0.25, 0.5, 0.75)]
    assert all(r < error(budget, False) for r, budget in zip(received, (0.25, 0.5, 0.75)))
    assert received == sorted(received, reverse=True)


@pytest.mark.parametrize("budget, fold", [(0.5, 1), (0.25, 2), (0.125, 4)])
def test_query_mixes_and_moment_at_head_width_equal_the_expanded_query_rows(budget, fold):
    model = build_tiny("llama", 384, num_key_value_heads=2)
    plan = plan_mla(inspect_config(model.config), kv_budget=budget, rope_fold=fold)
    attention = model.model.layers[0].self_attn
    D, d, group = model.config.hidden_size, plan.head_dim, plan.num_heads // plan.num_kv_heads
    x = torch.randn(500, D + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sigma = x.T @ x / len(x)
    Wq = augmented(attention.q_proj.weight, attention.q_proj.bias).detach()
    Wk = augmented(attention.k_proj.weight, attention.k_proj.bias).detach()
    bases = mla.fit.rorope_bases(Wk, sigma, plan)
    _, nope = mla.fit.split_components(plan)
    expanded = [torch.stack([sum(bases[i][j, m] * Wq[mla.fit.frequency_rows(h, f, d)[c]]
                                 for m, (g, f) in enumerate(plan.group_members(i)) if g == h // group) for j, i, c in nope])
                for h in range(plan.num_heads)]
    direct = sum(Q @ sigma @ Q.T for Q in expanded)
    mixes = mla.fit.query_mixes(bases, nope, plan)
    for h, Q in enumerate(expanded):  # T_g W_h is the expanded rows
        torch.testing.assert_close(mixes[h // group] @ Wq[h * d : (h + 1) * d], Q, rtol=0, atol=1e-12)
    torch.testing.assert_close(mla.fit.query_moment(Wq, sigma, mixes, plan), direct, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fmt,kv_heads", [("native", 6), ("exact", 6), ("native", 3)])
def test_per_head_no_rope_keys_equal_the_shared_one_with_fewer_parameters(fmt, kv_heads):
    """Each head's no-RoPE score read through its own head_dim query rows (``query_mixes``) is the score the
    shared no-RoPE key of the latent's width gives: the same closed form, head_dim wide instead of latent wide."""
    model = build_tiny("qwen2", 384, hidden_size=96, num_attention_heads=6, num_key_value_heads=kv_heads, head_dim=16)
    plan = plan_mla(inspect_config(model.config), kv_budget=0.5, format=fmt, nope_width="head")
    assert plan.qk_nope_dim == plan.head_dim < min(plan.nope_key_dim, plan.kv_rank)
    windows = torch.randint(0, 384, (4, 64), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0))
    per_head = convert(model, QWEN2, windows, plan).model
    shared = convert(model, QWEN2, windows, replace(plan, nope_width="latent")).model
    assert shared.config.qk_nope_head_dim > per_head.config.qk_nope_head_dim == plan.head_dim
    assert sum(p.numel() for p in per_head.parameters()) < sum(p.numel() for p in shared.parameters())
    with torch.no_grad():
        torch.testing.assert_close(per_head(ids).logits, shared(ids).logits, rtol=1e-4, atol=1e-4)


def test_refinement_lowers_every_layer_error_and_the_held_out_logit_error():
    model = build_tiny("llama", 384, num_key_value_heads=2)
    plan = plan_mla(inspect_config(model.config), kv_budget=0.5)
    windows = torch.randint(0, 384, (8, 64), generator=torch.Generator().manual_seed(1))
    held_out = torch.randint(0, 384, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(held_out).logits

    def relative_logit_error(steps: int) -> tuple[float, list]:
        result = convert(model, LLAMA, windows, plan, refinement=Refinement(steps, 512, 3e-3))
        mla, errors = result.model, result.layer_errors
        with torch.no_grad():
            return ((mla(held_out).logits - reference).pow(2).mean() / reference.pow(2).mean()).item(), errors

    closed_form, _ = relative_logit_error(0)
    refined, errors = relative_logit_error(40)
    assert len(errors) == 2 and all(e.after < 0.5 * e.before for e in errors), errors
    assert refined < 0.9 * closed_form


def test_refiner_carries_the_original_stream_and_fits_each_layer_relative_to_it(monkeypatch):
    """With a perfect fit at every layer the converted stream follows the original, which the refiner carries
    itself from the embeddings: both equal the model's own hidden states layer after layer. Each layer is
    asked for the original's residual update from the converted stream, every token relative to the
    original stream's size there."""
    from attnsurg.methods import mla

    model = build_tiny("llama", 384, num_key_value_heads=2)
    plan = plan_mla(inspect_config(model.config), kv_budget=0.5)
    ids = torch.randint(0, 384, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    asked = []

    def perfect_fit(w, config, index, o_weight, x, target, settings, token_scale, held_out, layout, alternatives):
        asked.append((target, token_scale))
        return w, mla.refine.LayerError(1.0, 0.0), target

    monkeypatch.setattr(mla.refine, "refine_layer", perfect_fit)
    refiner = mla.refine.SequentialRefiner(model.model.rotary_emb, LLAMA, hidden[0].clone(),
                                    deepseek_config(model, plan, model.model.rotary_emb.inv_freq))
    attention = model.model.layers[0].self_attn
    for index in range(model.config.num_hidden_layers):
        stream = refiner.stream.clone()
        refiner.refine(index, model.model.layers[index],
                       fit_layer(attention, torch.eye(model.config.hidden_size + 1, dtype=torch.float64), plan), Refinement(1))
        target, token_scale = asked[-1]
        torch.testing.assert_close(token_scale, (stream + target).pow(2).mean(-1, keepdim=True).rsqrt())
        expected = model.model.norm(refiner.original) if index == model.config.num_hidden_layers - 1 else refiner.original
        torch.testing.assert_close(expected, hidden[index + 1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(refiner.stream, refiner.original, rtol=1e-4, atol=1e-5)


def test_windows_cut_into_short_prompts_are_refined_as_prompts_of_their_own(monkeypatch):
    """With short prompts at the end of each window, the refiner's original stream is the model's own hidden
    states on each prompt run alone, and the converted layer's output is the layer run on each prompt alone."""
    from attnsurg.calibrate import prompts_of, short_prompt_starts
    from attnsurg.methods import mla
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    model = build_tiny("llama", 384, num_key_value_heads=2)
    plan = plan_mla(inspect_config(model.config), kv_budget=0.5)
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(1))
    starts = short_prompt_starts(ids, 0.5, seed=2)
    config = deepseek_config(model, plan, model.model.rotary_emb.inv_freq)
    config._attn_implementation = "sdpa"
    outputs, refine_layer = [], mla.refine.refine_layer

    def closed_form(w, config, index, o_weight, x, target, settings, token_scale, held_out, layout, alternatives):
        output = refine_layer(w, config, index, o_weight, x, target, Refinement(0), token_scale, held_out, layout)[2]
        outputs.append((w, x, output))
        return w, mla.refine.LayerError(1.0, 1.0), output

    monkeypatch.setattr(mla.refine, "refine_layer", closed_form)
    embeddings = model.get_input_embeddings()(ids)
    refiner = mla.refine.SequentialRefiner(model.model.rotary_emb, LLAMA, embeddings.detach().clone(), config, starts=starts)
    attention = model.model.layers[0].self_attn
    weights = fit_layer(attention, torch.eye(model.config.hidden_size + 1, dtype=torch.float64), plan)
    refiner.refine(0, model.model.layers[0], weights, Refinement(1))
    w, x, output = outputs[0]
    layer = mla.refine.mla_attention(config, 0, w, attention.o_proj.weight)
    rotary = DeepseekV3RotaryEmbedding(config)
    for i in range(2):
        bounds = torch.nonzero(starts[i]).flatten().tolist() + [48]
        with torch.no_grad():
            hidden = torch.cat([model(p[None], output_hidden_states=True).hidden_states[1][0] for p in prompts_of(ids[i], starts[i])])
            alone = torch.cat([layer(hidden_states=x[i:i + 1, a:b], attention_mask=causal_mask(b - a),
                                     position_embeddings=rotary(x[:1], torch.arange(b - a)[None]))[0][0]
                               for a, b in zip(bounds, bounds[1:])])
        torch.testing.assert_close(refiner.original[i], hidden, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(output[i], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("interleave", [True, False])
def test_sampled_output_is_the_attention_output_at_those_rows(q_lora_rank, interleave):
    """Refinement scores a subset of query rows against every key: it must be the module's own computation."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(hidden_size=48, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12,
                              q_lora_rank=q_lora_rank, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
                              rope_interleave=interleave, attention_bias=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attention = DeepseekV3Attention(config, 0)
    x = torch.randn(2, 20, 48)
    rope = DeepseekV3RotaryEmbedding(config)(x[:1], torch.arange(20)[None])
    with torch.no_grad():
        full = attention(hidden_states=x, position_embeddings=rope, attention_mask=causal_mask(20))[0]
        rows = torch.tensor([0, 3, 4, 11, 19])
        assert torch.allclose(sampled_output(attention, x, rope, rows), full[:, rows], atol=1e-6)
        assert torch.allclose(sampled_output(attention, x, rope, torch.arange(20)), full, atol=1e-6)


def first_layer_on_windows(model, count: int, length: int = 64):
    """The first attention layer's input on ``count`` random windows, the layer, and its output there."""
    from attnsurg.calibrate import attention_inputs

    windows = torch.randint(0, 384, (count, length), generator=torch.Generator().manual_seed(1))
    x = attention_inputs(model, LLAMA, windows)[0]
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        rope = model.model.rotary_emb(x[:1], torch.arange(length)[None])
        return x, attn, attn(hidden_states=x, position_embeddings=rope, attention_mask=causal_mask(length))[0]


def test_per_token_scale_keeps_one_huge_unreachable_target_from_ruling_the_refinement():
    """As the attention sink does in a real model: one token per window whose target is far out of reach. Measured
    relative to each token's size, the other tokens are fitted as well as if it were not there."""
    from attnsurg.calibrate import second_moment

    model = build_tiny("llama", 384, num_key_value_heads=2)
    plan = plan_mla(inspect_config(model.config), kv_budget=0.25)
    x, attn, clean = first_layer_on_windows(model, 4)
    sink = clean.clone()
    sink[:, 0] += 1e3 * clean.norm(dim=-1).mean() * torch.randn(4, clean.shape[-1], generator=torch.Generator().manual_seed(2))
    config = deepseek_config(model, plan, model.model.rotary_emb.inv_freq)
    config._attn_implementation = "sdpa"
    start = fit_layer(attn, second_moment(x), plan)

    def rest_error(target: torch.Tensor, token_scale=None) -> float:
        output = refine_layer(start, config, 0, attn.o_proj.weight, x, target, Refinement(30, lr=3e-3), token_scale)[2]
        return ((output - clean)[:, 1:].pow(2).mean() / clean[:, 1:].pow(2).mean()).item()

    closed_form = refine_layer(start, config, 0, attn.o_proj.weight, x, clean, Refinement(0))[2]
    closed_form_error = ((closed_form - clean)[:, 1:].pow(2).mean() / clean[:, 1:].pow(2).mean()).item()
    without_sink = rest_error(clean)
    scaled = rest_error(sink, sink.pow(2).mean(-1, keepdim=True).rsqrt())
    unscaled = rest_error(sink)
    assert without_sink < 0.8 * closed_form_error
    assert scaled < 1.5 * without_sink and scaled < 0.1 * unscaled, (closed_form_error, without_sink, scaled, unscaled)


@pytest.mark.parametrize("family,kv_heads", [("llama", 2), ("llama", 4), ("qwen2", 2)])
def test_full_budget_flexible_layout_is_exact(family, kv_heads):
    """The flexible layout keeps every RoPE component of every frequency: nothing is lost at full budget
    (GQA, MHA, and Qwen2 with q/k/v biases through the q_a / q_b route)."""
    model = build_tiny(family, 384, num_key_value_heads=kv_heads)
    plan = plan_mla(inspect_config(model.config), kv_budget=1.0, layout="flexible", format="exact")
    assert plan.rope_dim == kv_heads * 16 and plan.cached_values == plan.original_values + 1
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0))
    assert converted_error(model, plan, ids) < 1e-4


def test_rope_components_fill_tier_by_tier_from_the_highest_frequency():
    anatomy = inspect_config(build_tiny("llama", 384, num_key_value_heads=2).config)
    assert plan_mla(anatomy, kv_rank=16, rope_dim=10).counts == (1, 1, 1, 1, 1, 0, 0, 0)
    flexible = plan_mla(anatomy, kv_rank=16, rope_dim=24, layout="flexible")
    assert flexible.counts == (2, 2, 2, 2, 1, 1, 1, 1) and flexible.nope_key_dim == 32 - 24


@pytest.mark.parametrize("family, format, rope_dim", [("llama", "native", 16), ("llama", "exact", 16), ("qwen3", "native", 16),
                                                     ("llama", "native", 4)])
def test_error_falls_as_the_latent_grows(family, format, rope_dim):
    model = with_mean_direction(build_tiny(family, 384, num_key_value_heads=2))
    anatomy = inspect_config(model.config)
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0))
    plans = [plan_mla(anatomy, kv_rank=r, rope_dim=rope_dim, format=format) for r in (4, 16, 32, 48)]
    assert {plan.rope_fold for plan in plans} == {16 // rope_dim}  # 4 RoPE dims of head dim 16: FreqFold 4
    errors = [converted_error(model, plan, ids, family=family) for plan in plans]
    assert errors == sorted(errors, reverse=True), errors


def test_freq_fold_keeps_every_fth_frequency_and_spreads_the_pairs_over_the_spectrum():
    """Two RoPE pairs for eight frequencies: groups of four, each rotating at its highest source frequency,
    which the written rope_theta gives every engine (theta^(f R / d))."""
    model = build_tiny("llama", 384, num_key_value_heads=2)
    anatomy = inspect_config(model.config)
    plan = plan_mla(anatomy, kv_rank=16, rope_dim=4)
    assert plan.rope_fold == 4 and plan.groups == 2 and plan.counts == (1, 1)
    assert plan.group_members(1) == [(0, 4), (0, 5), (0, 6), (0, 7), (1, 4), (1, 5), (1, 6), (1, 7)]
    rope, nope = mla.fit.split_components(plan)
    assert len(rope) == plan.rope_dim and len(rope) + len(nope) == plan.num_kv_heads * plan.head_dim
    source_frequencies = model.model.rotary_emb.inv_freq
    config = mla.assemble.deepseek_config(model, plan, source_frequencies)
    written = DeepseekV3RotaryEmbedding(config).inv_freq
    torch.testing.assert_close(written, source_frequencies[::4].float(), rtol=1e-6, atol=0)
    assert mla.fit.rope_frequencies(plan, source_frequencies) == [float(f) for f in source_frequencies[::4]]
    assert plan_mla(anatomy, kv_budget=0.5, rope_dim=16).rope_fold == 1  # every frequency has its pair: no fold


@pytest.mark.parametrize("kwargs, fragment", [
    ({"kv_rank": 16, "rope_dim": 8, "rope_fold": 4}, "at most 2"),
    ({"kv_rank": 16, "rope_dim": 8, "rope_fold": 2, "layout": "flexible"}, "standard layout only"),
])
def test_freq_folds_the_layout_cannot_hold_are_refused(kwargs, fragment):
    anatomy = inspect_config(build_tiny("llama", 384, num_key_value_heads=2).config)
    with pytest.raises(UserError, match=fragment):
        plan_mla(anatomy, **kwargs)


def test_native_format_error_is_the_spread_of_its_constant_channel():
    """Without biases the latent norm's channel is a fitted near-constant: at full budget the native format
    errs by what its spread costs, which shrinks as the hidden states' mean direction grows, where the exact
    format reproduces the logits."""
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0))
    errors = []
    for shift in (1.0, 3.0, 9.0):
        model = with_mean_direction(build_tiny("llama", 384, num_key_value_heads=1), shift)
        plan = plan_mla(inspect_config(model.config), kv_budget=1.0)
        assert plan.format == "native" and plan.kv_rank == plan.full_rank
        errors.append(converted_error(model, plan, ids))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-2, errors


@pytest.mark.parametrize("variant,format", [("llama-gqa", "native"), ("llama-mha", "native"), ("mistral", "native"),
                                            ("qwen2", "native"), ("qwen2", "exact"), ("qwen3", "native")])
def test_saved_checkpoint_loads_in_stock_transformers_and_matches(variant, format, tiny_checkpoints, corpus_file, tmp_path):
    calibration = Calibration(data=TextData(text=corpus_file, part="calib"), tokens=512, seq_len=64)
    report = api.convert(str(tiny_checkpoints[variant]), tmp_path / "mla", kv_budget=0.5, format=format,
                         calibration=calibration, eval_tokens=256, eval_domains=[])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mla")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert model.config.first_k_dense_replace == model.config.num_hidden_layers and model.config.rope_interleave
    ids = torch.randint(0, 384, (1, 20), generator=torch.Generator().manual_seed(0))
    generated = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    layer = generated.past_key_values.layers[0]
    assert layer.keys.shape[-1] == report.plan.latent_width and layer.values.shape[-1] == report.plan.rope_dim
    assert report.plan.cached_values == report.plan.original_values // 2 + 1
    has_bias = any(name.endswith(".bias") for name in model.state_dict())
    assert has_bias == (format == "exact") and model.config.attention_bias == (format == "exact")
    assert sum(p.numel() for p in model.model.layers[0].self_attn.parameters()) == \
        report.plan.attention_parameters(model.config.hidden_size)
    card = (tmp_path / "mla" / "README.md").read_text()
    assert "ppl" in card and "calibration part" in card and "## Use it" in card and "trust_remote_code" not in card
    assert ("q/k norms: the source normalises" in card) == (variant == "qwen3")
    layers = model.config.num_hidden_layers
    attention = f"| attention parameters | {sum(p.numel() for n, p in AutoModelForCausalLM.from_pretrained(tiny_checkpoints[variant]).named_parameters() if '.self_attn.' in n):,} | "
    assert attention + f"{layers * report.plan.attention_parameters(model.config.hidden_size):,} |" in card
    metadata = ModelCard.load(tmp_path / "mla" / "README.md").data
    assert metadata.pipeline_tag == "text-generation" and "mla" in metadata.tags
    assert (tmp_path / "mla" / "attnsurg_recipe.yaml").is_file()
    assert report.ppl_after is not None and report.ppl_after > 0
    assert 0 < report.operation_seconds < report.seconds


def test_reload_equals_in_memory(tiny_checkpoints, tmp_path):
    source = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    plan = plan_mla(inspect_config(source.config), kv_budget=0.5)
    windows = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(0))
    mla = convert(source, LLAMA, windows, plan, refinement=Refinement(5)).model
    mla.save_pretrained(tmp_path / "m")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ids = torch.arange(30)[None]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, mla(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"kv_budget": 0.0}, "must be in (0, 1]"),
        ({"kv_budget": 1.5}, "must be in (0, 1]"),
        ({"kv_rank": 8, "rope_dim": 7}, "must be even"),
        ({"kv_rank": 8, "rope_dim": 32}, "head dim (16)"),
        ({"kv_rank": 8, "rope_dim": 34, "layout": "flexible"}, "KV heads x head dim (32)"),
        ({"kv_budget": 0.5, "layout": "diagonal"}, "unknown RoPE layout"),
        ({"kv_rank": 1000, "rope_dim": 16}, "above the full rank"),
        ({"kv_budget": 0.5, "kv_rank": 8}, "not both"),
    ],
)
def test_bad_budgets(tiny_checkpoints, kwargs, fragment):
    config = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"]).config
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        plan_mla(inspect_config(config), **kwargs)


def test_attention_mla_cannot_represent_is_refused():
    model = build_tiny("mistral", 384, num_key_value_heads=2)
    model.config.sliding_window = 32
    with pytest.raises(UserError, match="sliding-window"):
        plan_mla(inspect_config(model.config), kv_budget=0.5)


def test_cli_dry_run_prints_the_plan_and_writes_nothing(tiny_checkpoints, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "mla", "--kv-budget", "0.5",
                                 "-o", str(tmp_path / "out"), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert len(plan) == 2 and plan[0]["kv_values_before"] == 64 and plan[0]["kv_values_after"] == 33
    assert not (tmp_path / "out").exists()
    bad = runner.invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--kv-budget", "2", "--dry-run"])
    assert bad.exit_code == 2 and "--kv-budget: Input should be less than or equal to 1" in bad.stderr
    too_much = runner.invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--refine-tokens", "8192",
                                   "--calib-tokens", "4096", "-o", str(tmp_path / "out")])
    assert too_much.exit_code == 2 and "--calib-tokens" in too_much.stderr and len(too_much.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_output_keeps_the_source_dtype(tiny_checkpoints, corpus_file, tmp_path):
    source = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"], dtype=torch.bfloat16)
    source.save_pretrained(tmp_path / "bf16")
    (tmp_path / "bf16" / "tokenizer.json").write_bytes((tiny_checkpoints["llama-gqa"] / "tokenizer.json").read_bytes())
    (tmp_path / "bf16" / "tokenizer_config.json").write_bytes((tiny_checkpoints["llama-gqa"] / "tokenizer_config.json").read_bytes())
    calibration = Calibration(data=TextData(text=corpus_file, part="calib"), tokens=256, seq_len=64)
    api.convert(str(tmp_path / "bf16"), tmp_path / "mla", kv_budget=0.5, calibration=calibration, eval_tokens=0)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mla")
    assert reloaded.dtype == torch.bfloat16


def test_folded_checkpoint_says_so_and_reloads_with_the_folded_frequencies(tiny_checkpoints, corpus_file, tmp_path):
    calibration = Calibration(data=TextData(text=corpus_file, part="calib"), tokens=256, seq_len=64)
    api.convert(str(tiny_checkpoints["llama-gqa"]), tmp_path / "mla", kv_rank=8, rope_dim=4, refine_steps=0,
                calibration=calibration, eval_tokens=0)
    source = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mla")
    fold = source.config.head_dim // 4
    torch.testing.assert_close(reloaded.model.rotary_emb.inv_freq, source.model.rotary_emb.inv_freq[::fold][:2], rtol=1e-6, atol=0)
    assert f"group of {fold} neighbouring frequencies (FreqFold" in ModelCard.load(tmp_path / "mla" / "README.md").text


def test_cosine_refinement_schedule_decays_to_its_floor_and_constant_stays():
    from attnsurg.methods.mla.refine import COSINE_FLOOR, learning_rate_schedule

    for schedule, last in (("cosine", COSINE_FLOOR * 1e-3), ("constant", 1e-3)):
        optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        rates = learning_rate_schedule(optimizer, Refinement(10, lr=1e-3, schedule=schedule))
        for _ in range(10):
            optimizer.step()
            rates.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(last)


def test_refinement_never_trains_on_its_held_out_windows_and_keeps_the_step_they_score_best(monkeypatch):
    """The last windows are held out: no Adam step reads them, and the kept weights are the ones with the lowest
    held-out error (the closed form when no step lowers it). The converter holds out a quarter as many
    windows as refinement reads, taken after them."""
    from attnsurg.calibrate import second_moment
    from attnsurg.methods import mla

    model = build_tiny("llama", 384, num_key_value_heads=2)
    plan = plan_mla(inspect_config(model.config), kv_budget=0.5)
    x, attn, target = first_layer_on_windows(model, 10)
    config = deepseek_config(model, plan, model.model.rotary_emb.inv_freq)
    config._attn_implementation = "sdpa"
    trained_on = []
    original = mla.refine.sampled_output

    def watching(attention, inputs, rope, rows, visible=None):
        if torch.is_grad_enabled():
            trained_on.append(inputs)
        return original(attention, inputs, rope, rows, visible)

    monkeypatch.setattr(mla.refine, "sampled_output", watching)
    start = fit_layer(attn, second_moment(x), plan)
    _, errors, _ = refine_layer(start, config, 0, attn.o_proj.weight, x, target, Refinement(30, lr=3e-3), held_out=2)
    assert trained_on and not any(torch.equal(row, x[i]) for batch in trained_on for row in batch for i in (8, 9))
    assert any(torch.equal(row, x[0]) for batch in trained_on for row in batch)
    assert errors.held_after < errors.held_before and errors.after < errors.before
    assert errors.steps > 0 and errors.steps % mla.refine.HELD_OUT_CHECK == 0

    seen = []

    class Seen(Exception):
        pass

    def refiner(*args):
        seen.append(args[4])  # held_out
        raise Seen

    monkeypatch.setattr(mla.operator, "SequentialRefiner", refiner)
    with pytest.raises(Seen):
        convert(model, LLAMA, torch.randint(0, 384, (8, 64)), plan, refinement=Refinement(5, tokens=4 * 64))
    assert seen == [1]


def test_engine_checks_name_what_each_engine_would_not_run():
    anatomy = inspect_config(build_tiny("llama", 384, num_key_value_heads=2).config)
    assert plan_mla(anatomy, kv_budget=0.5, engine="llama.cpp").format == "native"
    assert plan_mla(anatomy, kv_budget=0.5, format="exact", engine="transformers").exact
    with pytest.raises(UserError, match=r"llama.cpp would not run .*--format native"):
        plan_mla(anatomy, kv_budget=0.5, format="exact", engine="llama.cpp")
    with pytest.raises(UserError, match=r"sglang would not run .*--rope-layout standard"):
        plan_mla(anatomy, kv_budget=0.5, layout="flexible", engine="sglang")
    with pytest.raises(UserError, match=r"kv_lora_rank \+ qk_rope_head_dim of 320, 512, 576, this plan has 33"):
        plan_mla(anatomy, kv_rank=16, rope_dim=16, engine="vllm")
    with pytest.raises(UserError, match=r"RoPE key of 64 dims, wider than this model's head dim 16"):
        plan_mla(anatomy, kv_budget=0.5, engine="vllm")


def test_a_budget_for_vllm_takes_the_widest_width_its_kernels_cache():
    """--engine vllm with a budget: 576 where the budget reaches it, else the widest of 320 / 512 within it; a
    budget below every width is refused with what the narrowest would cost, and a model whose whole cache is
    narrower than 320 is told that no vLLM width saves anything."""
    def anatomy(kv_heads):
        return inspect_config(build_tiny("llama", 384, hidden_size=576, num_attention_heads=9,
                                         num_key_value_heads=kv_heads, head_dim=64).config)

    full = plan_mla(anatomy(9), kv_budget=0.5, engine="vllm")  # 1,152 values: half is 576
    assert (full.cached_values, full.rope_dim, full.kv_rank) == (576, 64, 511) and not engine_problems(full, "vllm")
    assert "576 values per token, one of the widths vLLM's MLA kernels cache" in split_reason(full)
    assert plan_mla(anatomy(9), kv_budget=0.49, engine="vllm").cached_values == 512
    assert plan_mla(anatomy(3), kv_budget=1.0, engine="vllm").cached_values == 320  # 384 values: 512 is beyond
    with pytest.raises(UserError, match=r"--kv-budget 0.5 gives 192 of this model's 384 KV values per token.*"
                                        r"the narrowest, 320, costs 83% of the cache: pass --kv-budget 0.84"):
        plan_mla(anatomy(3), kv_budget=0.5, engine="vllm")
    assert plan_mla(anatomy(3), kv_budget=0.84, engine="vllm").cached_values == 320
    with pytest.raises(UserError, match=r"this model's whole KV cache is 256: every width vllm serves is larger"):
        plan_mla(anatomy(2), kv_budget=1.0, engine="vllm")


# What vLLM's and SGLang's DeepSeek attention builds when q_lora_rank is None and attention_bias is false (read
# from vllm/model_executor/models/deepseek_v2.py and sglang/srt/models/deepseek_v2.py): no other tensor loads.
ENGINE_ATTENTION_TENSORS = {"q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                            "o_proj.weight"}


def test_vllm_layout_pads_head_dims_to_its_kernel_shapes_and_unties_lm_head(tmp_path):
    """--engine vllm: latent + RoPE of one of vLLM's widths, (qk_nope, rope, v) zero-padded to one of its prefill
    shapes and lm_head written out (vLLM's DeepSeek never ties it); logits equal the unpadded conversion's."""
    model = with_mean_direction(build_tiny("llama", 384, hidden_size=384, num_attention_heads=6, num_key_value_heads=3,
                                           head_dim=64, tie_word_embeddings=True))
    anatomy = inspect_config(model.config)
    with pytest.raises(UserError, match=r"this plan has 193 \(--kv-rank 255 --rope-dim 64 gives 320 \(83% of the cache\)\)"):
        plan_mla(anatomy, kv_rank=128, rope_dim=64, engine="vllm")
    padded = plan_mla(anatomy, kv_rank=255, rope_dim=64, engine="vllm", nope_width="latent")
    plain = plan_mla(anatomy, kv_rank=255, rope_dim=64, nope_width="latent")
    assert (plain.qk_nope_dim, plain.head_dim) == (128, 64) and padded.written_dims == (128, 128)
    assert "decodes width 576 only, not this 320" in engine_note(padded)[0] and engine_note(plain) == []
    windows = torch.randint(0, 384, (4, 48), generator=torch.Generator().manual_seed(0))
    converted = convert(model, LLAMA, windows, padded).model
    reference = convert(model, LLAMA, windows, plain).model
    config = converted.config
    assert config.kv_lora_rank + config.qk_rope_head_dim in mla.engines.VLLM_MLA_WIDTHS
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) in mla.engines.VLLM_PREFILL_DIMS
    assert not config.tie_word_embeddings and reference.config.tie_word_embeddings
    assert sum(p.numel() for p in converted.model.layers[0].self_attn.parameters()) == padded.attention_parameters(384)
    converted.save_pretrained(tmp_path / "m")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names
    attention = {n.split(".self_attn.")[1] for n in names if ".self_attn." in n}
    assert attention == ENGINE_ATTENTION_TENSORS
    assert config.q_lora_rank is None and not config.attention_bias
    assert isinstance(config.n_routed_experts, int) and config.n_group < config.n_routed_experts
    assert config.first_k_dense_replace == config.num_hidden_layers
    ids = torch.arange(40)[None]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def first_layer_closed_form(windows: int):
    """A tiny Llama's first layer on ``windows`` windows, fitted at 50% KV (native): weights, config, inputs,
    the layer and its output."""
    from attnsurg.calibrate import second_moment

    model = build_tiny("llama", 384, num_key_value_heads=2)
    plan = plan_mla(inspect_config(model.config), kv_budget=0.5)
    x, attn, target = first_layer_on_windows(model, windows)
    config = deepseek_config(model, plan, model.model.rotary_emb.inv_freq)
    config._attn_implementation = "sdpa"
    return fit_layer(attn, second_moment(x), plan), config, x, attn, target


def test_a_learning_rate_that_helps_no_step_is_retried_lower_until_one_does():
    """At a rate far too large for the layer every step overshoots; refinement backs off by RATE_BACKOFF and
    keeps the steps of the first rate that lowers the held-out error, recording that rate."""
    from attnsurg.calibrate import second_moment
    from attnsurg.methods import mla

    model = build_tiny("llama", 384, num_key_value_heads=2)
    plan = plan_mla(inspect_config(model.config), kv_budget=0.5, format="exact")
    x, attn, target = first_layer_on_windows(model, 10)
    config = deepseek_config(model, plan, model.model.rotary_emb.inv_freq)
    config._attn_implementation = "sdpa"
    start = fit_layer(attn, second_moment(x), plan)
    assert mla.refine.backoff_rates(1e-3) == [1e-3, 1e-3 / mla.refine.RATE_BACKOFF, 1e-3 / mla.refine.RATE_BACKOFF**2]
    _, steady, _ = refine_layer(start, config, 0, attn.o_proj.weight, x, target, Refinement(30, lr=3e-3), held_out=2)
    assert steady.steps > 0 and steady.lr == 3e-3
    _, backed, _ = refine_layer(start, config, 0, attn.o_proj.weight, x, target, Refinement(30, lr=0.05), held_out=2)
    assert backed.steps > 0 and backed.lr in mla.refine.backoff_rates(0.05)[1:] and backed.held_after < backed.held_before
    _, hopeless, _ = refine_layer(start, config, 0, attn.o_proj.weight, x, target, Refinement(30, lr=1e3), held_out=2)
    assert hopeless.steps == 0 and hopeless.lr is None and hopeless.held_after == pytest.approx(hopeless.held_before)


def test_held_out_error_is_relative_to_the_held_out_windows_own_target():
    """A held-out window scores as it would if it were the training windows: a drifted training window with a
    huge target must not make the held-out error look small (it chose when refinement stopped)."""
    start, config, x, attn, target = first_layer_closed_form(6)
    inflated = target.clone()
    inflated[0] *= 100  # one training window far off
    _, errors, _ = refine_layer(start, config, 0, attn.o_proj.weight, x, inflated, Refinement(0), held_out=2)
    _, alone, _ = refine_layer(start, config, 0, attn.o_proj.weight, x[4:], target[4:], Refinement(0))
    assert errors.held_before == pytest.approx(alone.before, rel=1e-5)


def test_native_dominance_keeps_typical_tokens_and_bounds_a_token_whose_channel_vanishes():
    """``with_dominance`` rescales the constant channel and the latent norm's weight together: a token with
    a . x near 1 gets about the same normalised latent, and one with a . x = 0 is amplified by about the
    dominance, not more."""
    from attnsurg.calibrate import second_moment

    model = build_tiny("llama", 384, num_key_value_heads=2)
    plan = plan_mla(inspect_config(model.config), kv_budget=0.5)
    x, attn, _ = first_layer_on_windows(model, 4)
    sigma = second_moment(x)
    w = fit_layer(attn, sigma, plan)
    a = mla.fit.constant_direction(sigma)
    tokens = x.reshape(-1, x.shape[-1]).double()
    vanished = tokens - (tokens @ a)[:, None] * a[None] / a.dot(a)  # a . x = 0
    tokens = vanished + a[None] / a.dot(a)  # a . x = 1

    def normed_latent(w, inputs):
        r = plan.kv_rank
        latent = inputs @ w.kv_a_weight[: r + 1].T
        rms = latent.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        return (w.kv_a_norm * latent / rms)[:, :r]

    typical = normed_latent(w, tokens)
    for dominance in mla.fit.CHANNEL_DOMINANCES:
        other = mla.fit.with_dominance(w, dominance)
        gap = (normed_latent(other, tokens) - typical).norm() / typical.norm()
        assert gap < (0.02 if dominance >= 8 else 0.3), (dominance, gap)  # the channel's share of the norm shrinks
        growth = normed_latent(other, vanished).norm(dim=-1) / typical.norm(dim=-1)
        assert growth.max() < 2 * dominance, (dominance, growth.max())
    assert normed_latent(w, vanished).norm(dim=-1).div(typical.norm(dim=-1)).max() > 4


def test_refinement_starts_from_the_closed_form_alternative_with_the_lowest_error():
    good, config, x, attn, target = first_layer_closed_form(4)
    bad = replace(good, kv_b_proj=good.kv_b_proj * 3)
    kept, errors, _ = refine_layer(bad, config, 0, attn.o_proj.weight, x, target, Refinement(0), alternatives=[good])
    _, alone, _ = refine_layer(good, config, 0, attn.o_proj.weight, x, target, Refinement(0))
    assert kept is good and errors.before == pytest.approx(alone.before)
    anatomy = inspect_config(build_tiny("llama", 384, num_key_value_heads=2).config)
    assert mla.fit.closed_form_alternatives(good, plan_mla(anatomy, kv_budget=0.5))
    assert not mla.fit.closed_form_alternatives(good, plan_mla(anatomy, kv_budget=0.5, format="exact"))


def test_native_closed_forms_span_every_ridge_and_dominance_the_default_first():
    """``layer_closed_forms``: in the native format one closed form per (ridge, dominance), the default ridge's
    first and equal to ``fit_layer``'s; a smaller ridge brings a . x closer to 1 on the calibration tokens; the
    exact format has one closed form."""
    from attnsurg.calibrate import InputStatistics

    model = build_tiny("qwen2", 384, num_key_value_heads=2)
    anatomy = inspect_config(model.config)
    plan = plan_mla(anatomy, kv_budget=0.5)
    x, attn, _ = first_layer_on_windows(model, 4)
    stats = InputStatistics()
    stats.add(x)
    forms = mla.fit.layer_closed_forms(attn, stats, plan, True, None)
    assert len(forms) == len(mla.fit.CONSTANT_RIDGES) * len(mla.fit.CHANNEL_DOMINANCES)
    first = fit_layer(attn, stats.sigma, plan, True, stats.sigma_first)
    assert all(torch.equal(getattr(forms[0], f), getattr(first, f)) for f in ("q_proj", "kv_a_weight", "kv_b_proj"))
    tokens = x.reshape(-1, x.shape[-1]).double()
    misses = [(tokens @ mla.fit.constant_direction(stats.sigma, stats.sigma_first, ridge) - 1).pow(2).mean()
              for ridge in sorted(mla.fit.CONSTANT_RIDGES, reverse=True)]
    assert all(later < earlier for earlier, later in zip(misses, misses[1:])), misses
    assert not torch.equal(forms[0].q_proj, forms[len(mla.fit.CHANNEL_DOMINANCES)].q_proj)  # the query bias folds on a
    assert len(mla.fit.layer_closed_forms(attn, stats, plan_mla(anatomy, kv_budget=0.5, format="exact"), True, None)) == 1


def test_the_report_names_the_closed_form_each_layer_started_from():
    from attnsurg.methods.mla.report import ConvertReport, layer_error_lines, layer_error_records

    anatomy = inspect_config(build_tiny("qwen2", 384, num_key_value_heads=2).config)
    plan = plan_mla(anatomy, kv_budget=0.5)
    labels = mla.fit.closed_form_labels(plan)
    assert len(labels) == len(mla.fit.CONSTANT_RIDGES) * len(mla.fit.CHANNEL_DOMINANCES) and len(set(labels)) == len(labels)
    errors = [mla.refine.LayerError(1.0, 0.5, start=start) for start in (0, len(labels) - 1, len(labels) - 1)]
    report = ConvertReport(plan=plan, anatomy=anatomy, layer_errors=errors)
    assert f"{labels[-1]} in 2; {labels[0]} in 1" in layer_error_lines(report)[-1]
    assert [r["start"] for r in layer_error_records(report)] == [labels[0], labels[-1], labels[-1]]
    exact = ConvertReport(plan=plan_mla(anatomy, kv_budget=0.5, format="exact"), anatomy=anatomy,
                          layer_errors=[mla.refine.LayerError(1.0, 0.5)])
    assert not any("started from" in line for line in layer_error_lines(exact))


def test_rope_key_bias_folds_whole_on_fast_pairs_and_drops_on_slow_ones():
    """The shrinkage of a native-format RoPE key bias: near 1 where the pair turns many times over the span
    (its bias term varies across keys), near 0 where it barely turns (the softmax is blind to it), monotone
    between, and a wider spread of the constant channel shrinks more."""
    frequencies = torch.tensor([1.0, 1e-2, 1e-3, 1e-4, 1e-6])
    beta = mla.fit.rope_bias_shrinkage(frequencies, spread=0.01, span=1024)
    assert beta.shape == (10,) and torch.equal(beta[0::2], beta[1::2])  # both rows of a pair alike
    pairs = beta[0::2]
    assert pairs[0] > 0.98 and pairs[-1] < 1e-3 and torch.all(pairs[:-1] >= pairs[1:])
    assert torch.all(mla.fit.rope_bias_shrinkage(frequencies, spread=0.1, span=1024) <= beta)


def test_native_fit_shrinks_slow_key_biases_and_errs_less_on_a_biased_model():
    """A Qwen2-like layer whose key bias sits on its slowest RoPE frequencies (as Qwen2.5's does): folded whole
    through the fitted constant channel, the bias carries the channel's spread into every score; shrunk, the
    layer's output is closer to the original's. A model without biases gets the very same weights."""
    rope = {"rope_type": "default", "rope_theta": 1e6}  # Qwen2.5's: the slow half barely turns over a context
    model = with_mean_direction(build_tiny("qwen2", 384, num_key_value_heads=2, rope_parameters=rope), 1.0)
    attn = model.model.layers[0].self_attn
    d = model.config.head_dim
    with torch.no_grad():
        bias = attn.k_proj.bias.view(2, 2, d // 2)  # [KV head, pair part, frequency]
        bias.zero_()
        bias[..., d // 4:] = 20.0  # the slower half of the frequencies
    plan = plan_mla(inspect_config(model.config), kv_budget=1.0)  # nothing compressed: the format alone
    x, attn, target = first_layer_on_windows(model, 4)
    sigma = second_moment(x)
    config = deepseek_config(model, plan, model.model.rotary_emb.inv_freq)
    config._attn_implementation = "sdpa"
    rope = DeepseekV3RotaryEmbedding(config)(x[:1], torch.arange(x.shape[1])[None])

    def error(w) -> float:
        output = sampled_output(mla.refine.mla_attention(config, 0, w, attn.o_proj.weight), x, rope, torch.arange(x.shape[1]))
        return float((output - target)[:, 1:].pow(2).sum().detach() / target[:, 1:].pow(2).sum())

    inv_freq = model.model.rotary_emb.inv_freq
    whole, shrunk = fit_layer(attn, sigma, plan), fit_layer(attn, sigma, plan, inv_freq=inv_freq)
    assert error(shrunk) < 0.5 * error(whole), (error(shrunk), error(whole))
    with torch.no_grad():
        attn.k_proj.bias.zero_()
    unbiased = fit_layer(attn, sigma, plan)
    assert torch.equal(unbiased.kv_a_weight, fit_layer(attn, sigma, plan, inv_freq=inv_freq).kv_a_weight)


def test_default_rope_width_is_a_third_of_the_budget_whatever_the_number_of_kv_heads():
    """The widest head_dim / f within a third of the budget: the demo's 3 KV heads at 0.5 keep 64 of 192
    values, Qwen2.5's 2 at 0.5 keep 32 of 128 (64 would starve the latent, 42 would leave the slow
    frequencies without a pair); the whole original cache keeps every component."""
    assert mla.plan.default_rope_dim(192, 64, 64, 384) == 64
    assert mla.plan.default_rope_dim(128, 64, 64, 256) == 32
    assert mla.plan.default_rope_dim(64, 64, 64, 256) == 16
    assert mla.plan.default_rope_dim(4, 64, 64, 256) == 2
    assert mla.plan.default_rope_dim(96, 64, 64, 384) == 32
    assert mla.plan.default_rope_dim(256, 64, 64, 256) == 64
    assert mla.plan.default_rope_dim(512, 64, 128, 512) == 128  # flexible layout, two KV heads, full budget


def test_default_rope_width_is_at_most_deepseeks_below_the_full_budget():
    """Llama-3.1-8B (8 KV heads of 128) at 0.5 keeps 64 RoPE dims, not 128, and FreqFold 2 spreads them over
    every frequency; a head of 96 keeps 48 (a pair per group of two); the full budget keeps every component."""
    assert mla.plan.default_rope_dim(1024, 128, 128, 2048) == 64
    assert mla.plan.default_rope_fold(128, 64, "standard") == 2
    assert mla.plan.default_rope_dim(1536, 96, 96, 3072) == 48
    assert mla.plan.default_rope_dim(2048, 128, 128, 2048) == 128
