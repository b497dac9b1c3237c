import json

import pytest
import torch
from transformers import DynamicCache
from typer.testing import CliRunner

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.cli import app
from attnsurg.errors import UserError
from attnsurg.eval.speed import cache_bytes
from attnsurg.io.load import load_model, resolve_source
from attnsurg.methods.base import SurgeryInputs, method_for
from attnsurg.methods.linear.method import LinearReport, LinearSettings
from attnsurg.methods.linear.transfer import HybridShape, LayerTransfer, Transfer
from attnsurg.modeling import modeling_attnsurg
from attnsurg.requests import COMMAND_CALIBRATION

from conftest import assert_streamed_like_loaded, build_tiny, greedy_decode_matches_recomputation
from helpers import VOCAB, held_out, logit_error, remote_code_matches_attnsurg, streamed_and_loaded


def windows(n: int = 8, length: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def converted(model, family: str, **settings) -> tuple[torch.nn.Module, LinearReport]:
    settings = LinearSettings(**settings)
    method = method_for(settings)
    report = LinearReport(method.plan(inspect_config(model.config), settings), inspect_config(model.config))
    inputs = SurgeryInputs(family_for_surgery(family), windows(), COMMAND_CALIBRATION)
    return method.operate_model(model, inputs, settings, report), report


@pytest.mark.parametrize("family,feature_map", [("llama", "hedgehog"), ("qwen2", "hedgehog"), ("qwen3", "hedgehog"),
                                                ("mistral", "hedgehog"), ("qwen2", "performer")])
def test_a_window_as_long_as_the_context_reproduces_the_logits(family, feature_map):
    model = build_tiny(family, VOCAB, num_key_value_heads=2)
    linear, _ = converted(model, family, window=48, feature_map=feature_map, transfer_steps=5)
    assert logit_error(linear, model, held_out()) < 1e-4


@pytest.mark.parametrize("family,batch,sinks,feature_map,decay,before_rope", [
    ("llama", 1, 4, "hedgehog", False, False), ("llama", 2, 4, "hedgehog", False, False),
    ("llama", 1, 0, "hedgehog", False, False), ("llama", 2, 4, "performer", False, False),
    ("qwen2", 1, 4, "performer", False, False), ("llama", 2, 4, "hedgehog", True, False),
    ("qwen2", 1, 0, "performer", True, False), ("llama", 2, 4, "hedgehog", True, True),
])
def test_decoding_token_by_token_equals_the_parallel_form(monkeypatch, family, batch, sinks, feature_map, decay,
                                                          before_rope):
    model = build_tiny(family, VOCAB, num_key_value_heads=2)
    if family == "qwen2":  # key biases as large as Qwen2's, which put every key far from the origin
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.bias.normal_(0, 30.0, generator=torch.Generator().manual_seed(0))
    linear, _ = converted(model, family, window=6, sinks=sinks, feature_map=feature_map, transfer_steps=5,
                          decay=decay, features_before_rope=before_rope)
    if decay:  # fast enough to matter over 40 tokens, and different per KV head
        with torch.no_grad():
            for layer in linear.model.layers:
                layer.self_attn.log_decay.copy_(torch.tensor([0.05, 0.3]).log())
    ids = held_out()[:batch, :40]
    with torch.no_grad():
        parallel = linear(ids, use_cache=False).logits  # one chunk: the whole sequence at once
        cache = DynamicCache()
        prefix = linear(ids[:, :9], cache=cache).logits
        steps = [linear(ids[:, t : t + 1], cache=cache).logits for t in range(9, 40)]
        monkeypatch.setattr(modeling_attnsurg, "LINEAR_CHUNK", 7)  # a prompt taken in chunks, as a long one is
        chunked = linear(ids, use_cache=False).logits
    assert torch.allclose(torch.cat([prefix, *steps], 1), parallel, atol=1e-5)
    assert torch.allclose(chunked, parallel, atol=1e-5)
    assert cache.get_seq_length() == 40


def test_without_the_linear_part_the_sinks_and_the_window_are_softmax_attention():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 4, 20, 8, generator=generator) for _ in range(3))
    features = torch.rand(1, 4, 20, 6, generator=generator)
    window, sinks = 5, 3
    got = modeling_attnsurg.hybrid_attention(query, key, value, features, features, window, 0.5,
                                             torch.full((4,), -1e4), sinks=sinks)
    distance = torch.arange(20)[:, None] - torch.arange(20)[None, :]
    seen = (distance >= 0) & ((distance < window) | (torch.arange(20)[None, :] < sinks))
    want = torch.softmax((query @ key.transpose(-1, -2) * 0.5).masked_fill(~seen, float("-inf")), -1) @ value
    assert torch.allclose(got, want, atol=1e-6)


def test_only_keys_a_window_before_the_last_query_are_read_through_their_features():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 6, 8, generator=generator)  # the last 6 of 20 keys, two query heads per KV head
    key, value = (torch.randn(1, 2, 20, 8, generator=generator) for _ in range(2))
    log_q, log_k = torch.randn(1, 4, 6, 5, generator=generator), torch.randn(1, 2, 20, 5, generator=generator)
    window = 7  # keys 0..12 are at least a window before the last query (19)
    whole = modeling_attnsurg.hybrid_attention(query, key, value, log_q, log_k, window, 0.3, torch.zeros(4),
                                               sinks=2, decay=torch.tensor([0.0, 0.2]))
    read = modeling_attnsurg.hybrid_attention(query, key, value, log_q, log_k[:, :, :13], window, 0.3,
                                              torch.zeros(4), sinks=2, decay=torch.tensor([0.0, 0.2]))
    assert torch.equal(read, whole)
    unread = log_k.clone()
    unread[:, :, 13:] += 50.0
    moved = unread.clone()
    moved[:, :, 12] += 50.0
    same = modeling_attnsurg.hybrid_attention(query, key, value, log_q, unread, window, 0.3, torch.zeros(4), sinks=2)
    other = modeling_attnsurg.hybrid_attention(query, key, value, log_q, moved, window, 0.3, torch.zeros(4), sinks=2)
    plain = modeling_attnsurg.hybrid_attention(query, key, value, log_q, log_k, window, 0.3, torch.zeros(4), sinks=2)
    assert torch.allclose(same, plain, atol=1e-6)
    assert not torch.allclose(other, plain, atol=1e-3)


def performer_error(features: int, query, key, value) -> float:
    """The hybrid with one exact key (itself) and Performer's features against full causal softmax attention."""
    from attnsurg.linalg import orthogonal_gaussian

    d = query.shape[-1]
    weight = orthogonal_gaussian(features, d, torch.Generator().manual_seed(features)).T.float()[None]
    log_q, log_k = (modeling_attnsurg.performer_log(x, weight, d**-0.5) for x in (query, key))
    got = modeling_attnsurg.hybrid_attention(query, key, value, log_q, log_k, 1, d**-0.5, torch.zeros(1),
                                             anchored=True)
    causal = torch.ones(query.shape[2], query.shape[2], dtype=torch.bool).tril()
    want = torch.softmax((query @ key.transpose(-1, -2) * d**-0.5).masked_fill(~causal, float("-inf")), -1) @ value
    return ((got - want).norm() / want.norm()).item()


def reference_hybrid(query, key, value, log_q, log_k, window: int, scaling: float, decay: float = 0.0) -> torch.Tensor:
    """Performer's hybrid in float64: key j weighs exp(s_ij) in the window, else
    exp(-decay (i - j)) sum_f phi_f(q) phi_f(k)."""
    q, k, v, log_q, log_k = (t.double() for t in (query, key, value, log_q, log_k))
    distance = torch.arange(q.shape[2])[:, None] - torch.arange(k.shape[2])[None, :]
    exact = (q @ k.transpose(-1, -2) * scaling).masked_fill(~((distance >= 0) & (distance < window)), float("-inf"))
    linear = torch.logsumexp(log_q[..., :, None, :] + log_k[..., None, :, :], dim=-1) - decay * distance
    logs = torch.where(distance >= window, linear, exact)
    return torch.softmax(logs, dim=-1) @ v


def test_the_linear_part_neither_overflows_nor_underflows_at_any_feature_scale():
    """Qwen2's key biases put every key far from the origin, so log phi(k) is far below zero and log phi(q) far
    above it: in float32 exp(log phi(k)) is 0 and exp(log phi(q)) inf, unless the state is held under a shift."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 1, 24, 16, generator=generator) for _ in range(3))
    log_q, log_k = (2 * torch.randn(1, 1, 24, 8, generator=generator) for _ in range(2))
    for offset in (0.0, 120.0, 400.0):
        got = modeling_attnsurg.hybrid_attention(query, key, value, log_q + offset, log_k - offset, 4, 0.25,
                                                 torch.zeros(1), anchored=True)
        want = reference_hybrid(query, key, value, log_q + offset, log_k - offset, 4, 0.25)
        assert torch.allclose(got.double(), want, atol=1e-5), offset
    linear_share = (want - reference_hybrid(query, key, value, log_q, log_k - 1e9, 4, 0.25)).norm() / want.norm()
    assert linear_share > 0.1  # the linear part counts


def test_a_decay_fades_the_linear_part_with_distance():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 24, 16, generator=generator) for _ in range(3))
    log_q, log_k = (torch.randn(1, 2, 24, 8, generator=generator) for _ in range(2))
    for decay in (0.0, 0.1, 2.0):
        got = modeling_attnsurg.hybrid_attention(query, key, value, log_q, log_k, 4, 0.25, torch.zeros(2),
                                                 anchored=True, decay=torch.full((2,), decay))
        want = reference_hybrid(query, key, value, log_q, log_k, 4, 0.25, decay)
        assert torch.allclose(got.double(), want, atol=1e-5), decay


def test_performer_features_approach_softmax_attention_as_they_widen():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 1, 32, 16, generator=generator) for _ in range(3))
    query, key = query / 2, key / 2  # scores of spread 1/4: the estimator's variance grows as exp(|q + k|^2)
    errors = [performer_error(features, query, key, value) for features in (4, 64, 1024)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.1


def test_a_performer_conversion_trains_nothing_and_shares_each_kv_heads_features():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    linear, report = converted(model, "llama", window=6, feature_map="performer")
    attention = linear.model.layers[0].self_attn
    assert report.plan.feature_map == "performer" and all(e.steps == 0 and e.after == e.before for e in report.layer_errors)
    assert torch.equal(attention.feature_q, attention.feature_k.repeat_interleave(2, dim=0))


def test_features_read_before_rope_see_no_position():
    """Shifting every position leaves such a hybrid's logits as they are, as it leaves softmax attention's."""
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    linear, _ = converted(model, "llama", window=6, transfer_steps=5, features_before_rope=True)
    ids = held_out()[:1, :40]
    with torch.no_grad():
        logits = [linear(ids, position_ids=torch.arange(40)[None] + offset, use_cache=False).logits
                  for offset in (0, 3000)]
    assert torch.allclose(logits[0], logits[1], atol=1e-4)


@pytest.mark.parametrize("scale", [1.0, 1.3])  # 1.3: a RoPE variant that scales as it rotates (YaRN)
def test_cached_keys_are_rotated_back_to_what_the_maps_read_before_rope(scale):
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    linear, _ = converted(model, "llama", window=6, transfer_steps=0, features_before_rope=True)
    attention = linear.model.layers[0].self_attn
    rotary = attention.rotary
    attention.rotary = lambda x, positions: tuple(scale * t for t in rotary(x, positions))
    keys = torch.randn(2, 2, 9, attention.head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = attention.rotary(keys, torch.arange(100, 109)[None])
    rotated = modeling_attnsurg.apply_rope(keys, cos, sin)
    assert torch.allclose(attention.keys_read(rotated, 100), keys, atol=1e-5)


def test_generate_decodes_what_recomputing_every_prefix_gives():
    model = build_tiny("qwen2", VOCAB, num_key_value_heads=2)
    linear, _ = converted(model, "qwen2", window=5, transfer_steps=5)
    assert greedy_decode_matches_recomputation(linear, held_out()[:1, :12], 20)


@pytest.mark.parametrize("before_rope", [False, True])
def test_the_cache_does_not_grow_with_the_context(before_rope):
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    linear, report = converted(model, "llama", window=4, transfer_steps=0, features_before_rope=before_rope)
    cache, sizes = DynamicCache(), []
    with torch.no_grad():
        linear(held_out()[:1, :8], cache=cache)
        for t in range(40):
            linear(torch.tensor([[t % VOCAB]]), cache=cache)
            sizes.append(cache_bytes(cache))
    plan = report.plan
    planned = 4 * plan.num_layers * plan.state_values(48)  # float32 window and state; the window's storage
    assert sizes[5] == sizes[-1] and planned <= sizes[-1] <= planned * 1.1  # also holds the token just added


def test_attention_transfer_lowers_the_held_out_error_as_features_widen():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    family = family_for_surgery("llama")
    layer = model.model.layers[0]
    with torch.no_grad():
        stream = model.get_input_embeddings()(windows(12, 48))
    held = []
    for features in (1, 4, 16):
        transfer = LayerTransfer(family, model.model.rotary_emb, stream)
        _, error = transfer.fit(layer, model.config, 0, HybridShape(4, features), Transfer(steps=200, lr=1e-2),
                                held_out=3)
        assert error.held_after < error.held_before and error.after < error.before
        held.append(error.held_after)
    assert held[0] > held[1] > held[2]


@pytest.mark.parametrize("given,decays,before_rope", [
    ({}, True, True), ({"feature_map": "performer"}, False, False),
    ({"decay": False, "features_before_rope": False}, False, False),
    ({"feature_map": "performer", "features_before_rope": True}, False, True),
])
def test_learned_maps_decay_and_read_before_rope_unless_told_otherwise(given, decays, before_rope):
    settings = LinearSettings(**given)
    assert (settings.decays, settings.reads_before_rope) == (decays, before_rope)


def test_cli_writes_a_checkpoint_that_reloads_equal(tiny_checkpoints, corpus_file, tmp_path):
    out = tmp_path / "linear"
    args = ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear", "--window", "8", "--transfer-steps", "20",
            "--calib-text", str(corpus_file), "--calib-tokens", "1024", "--calib-seq-len", "64",
            "--eval-tokens", "256", "--eval-domains", "none", "-o", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["plan"]["window"] == 8 and len(record["layer_errors"]) == 2
    assert record["layer_errors"][0]["after"] < record["layer_errors"][0]["before"]
    assert json.loads((out / "config.json").read_text())["attnsurg"]["linear"] == {"window": 8, "feature_dim": 16, "sinks": 4,
                                                                                 "feature_map": "hedgehog", "decay": True,
                                                                                 "features_before_rope": True}
    reloaded = load_model(resolve_source(str(out)))
    assert isinstance(reloaded.model.layers[0].self_attn, modeling_attnsurg.HybridLinearAttention)
    assert 0 < reloaded.model.layers[0].self_attn.decay().min() < 1
    anatomy = inspect_config(reloaded.config)  # the cache a reader of the checkpoint is told of: fixed past the window
    assert not anatomy.qk_norm  # the source (Llama) has none; the replaced attention holds empty slots for them
    assert anatomy.cache_values(10_000) == anatomy.cache_values(100_000) < anatomy.kv_values_per_token * 10_000 / 50
    assert remote_code_matches_attnsurg(out, tmp_path)
    with torch.no_grad():  # the written model is the scored one: its perplexity on the same windows
        source = load_model(resolve_source(str(tiny_checkpoints["llama-gqa"])))
        assert logit_error(reloaded, source, held_out()) > 1e-3  # the window is shorter than the context


def test_cli_writes_a_performer_checkpoint_that_reloads_equal(tiny_checkpoints, corpus_file, tmp_path):
    out = tmp_path / "performer"
    args = ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear", "--window", "8", "--feature-map",
            "performer", "--calib-text", str(corpus_file), "--calib-tokens", "512", "--calib-seq-len", "64",
            "--eval-tokens", "128", "--eval-domains", "none", "-o", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["plan"]["feature_map"] == "performer" and {e["steps"] for e in record["layer_errors"]} == {0}
    assert json.loads((out / "config.json").read_text())["attnsurg"]["linear"]["feature_map"] == "performer"
    assert remote_code_matches_attnsurg(out, tmp_path)


def test_an_unknown_feature_map_is_one_line(tiny_checkpoints, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear",
                                      "--feature-map", "cosformer", "-o", str(tmp_path / "x")])
    assert result.exit_code != 0 and result.output == "error: --feature-map: Input should be 'hedgehog' or 'performer'\n"


def test_streamed_writes_the_loaded_conversion(tiny_checkpoints, corpus_file, tmp_path):
    common = ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear", "--window", "8", "--transfer-steps", "20",
              "--calib-text", str(corpus_file), "--calib-tokens", "1024", "--calib-seq-len", "64", "--eval-tokens", "128",
              "--eval-domains", "none", "--json"]
    records, tensors = streamed_and_loaded(common, tmp_path)
    for a, b in zip(records["--stream"]["layer_errors"], records["--no-stream"]["layer_errors"], strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    streamed, loaded = tensors["--stream"], tensors["--no-stream"]
    assert streamed.keys() == loaded.keys()
    assert all(torch.allclose(streamed[k], loaded[k], atol=1e-5) for k in loaded)
    assert_streamed_like_loaded(tmp_path / "--no-stream", tmp_path / "--stream")


@pytest.mark.parametrize("extra, fragment", [
    (["--kv-budget", "0.5"], "--kv-budget does not apply to --to linear"),
    (["--window", "0"], "window"),
])
def test_bad_input_is_one_line(tiny_checkpoints, tmp_path, extra, fragment):
    result = CliRunner().invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear", *extra,
                                      "-o", str(tmp_path / "never")])
    assert result.exit_code == 2 and fragment in result.output and not (tmp_path / "never").exists()


def test_mla_options_stay_mla_only(tiny_checkpoints, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--window", "8",
                                      "-o", str(tmp_path / "never")])
    assert result.exit_code == 2 and "--window does not apply to --to mla" in result.output


def test_sliding_window_models_are_refused():
    from attnsurg.methods.linear.method import plan_linear

    model = build_tiny("mistral", VOCAB, num_key_value_heads=2, sliding_window=16)
    anatomy = inspect_config(model.config)
    if not anatomy.sliding_layers:
        pytest.skip("this transformers version reports no sliding layers for Mistral")
    with pytest.raises(UserError, match="sliding window"):
        plan_linear(anatomy, LinearSettings())


def test_heal_trains_the_converted_attention_and_lowers_perplexity(tiny_checkpoints, corpus_file, tmp_path):
    student = tmp_path / "student"
    convert = ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear", "--window", "4", "--transfer-steps", "10",
               "--calib-text", str(corpus_file), "--calib-tokens", "1024", "--calib-seq-len", "64", "--eval-tokens", "0",
               "-o", str(student)]
    assert CliRunner().invoke(app, convert).exit_code == 0
    heal = ["heal", str(student), "--teacher", str(tiny_checkpoints["llama-gqa"]), "--text", str(corpus_file),
            "--tokens", "2048", "--seq-len", "64", "--lr", "1e-3", "--eval-tokens", "256", "--eval-domains", "none",
            "-o", str(tmp_path / "healed"), "--json"]
    result = CliRunner().invoke(app, heal)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["ppl_after"] < record["ppl_before"]
    healed = load_model(resolve_source(str(tmp_path / "healed")))
    before = load_model(resolve_source(str(student)))
    attention = healed.model.layers[0].self_attn
    assert isinstance(attention, modeling_attnsurg.HybridLinearAttention)
    assert not torch.equal(attention.feature_q, before.model.layers[0].self_attn.feature_q)


def test_full_layers_keep_softmax_attention_and_every_layer_full_reproduces_the_logits():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    layers = len(model.model.layers)
    every, report = converted(model, "llama", window=8, transfer_steps=5, full_layers=tuple(range(layers)))
    assert logit_error(every, model, held_out()) < 1e-4 and report.layer_errors == []
    one, report = converted(model, "llama", window=8, transfer_steps=5, full_layers=(1,))
    assert not isinstance(one.model.layers[1].self_attn, modeling_attnsurg.HybridLinearAttention)
    assert isinstance(one.model.layers[0].self_attn, modeling_attnsurg.HybridLinearAttention)
    assert len(report.layer_errors) == layers - 1 and logit_error(one, model, held_out()) > 1e-3
    plan = report.plan  # the full layer's cache grows with the context, the hybrid ones' stop at the window
    assert plan.cache_values(1000) - plan.cache_values(500) == plan.original_values(500)
    assert inspect_config(one.config).cache_values(1000) == plan.cache_values(1000)


def test_full_layers_stream_to_the_checkpoint_a_whole_load_writes(tiny_checkpoints, corpus_file, tmp_path):
    common = ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear", "--window", "8", "--transfer-steps", "5",
              "--full-layers", "1", "--calib-text", str(corpus_file), "--calib-tokens", "768", "--calib-seq-len", "64",
              "--eval-domains", "none", "--json"]
    records, tensors = streamed_and_loaded(common, tmp_path)
    assert all(record["plan"]["full_layers"] == [1] for record in records.values())
    streamed, loaded = tensors["--stream"], tensors["--no-stream"]
    assert streamed.keys() == loaded.keys() and not any(".layers.1.self_attn.feature" in k for k in loaded)
    assert any(".layers.0.self_attn.feature" in k for k in loaded)
    assert all(torch.allclose(streamed[k], loaded[k], atol=1e-5) for k in loaded)
    reloaded = load_model(resolve_source(str(tmp_path / "--stream")))
    assert not isinstance(reloaded.model.layers[1].self_attn, modeling_attnsurg.HybridLinearAttention)


def test_a_full_layer_the_model_lacks_is_one_line(tiny_checkpoints, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear",
                                      "--full-layers", "1,7", "-o", str(tmp_path / "x")])
    assert result.exit_code == 2 and result.output == "error: --full-layers 7: the model has layers 0-1\n"


def test_full_layers_that_are_not_indices_are_one_line(tiny_checkpoints, tmp_path):
    result = CliRunner().invoke(app, ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "linear",
                                      "--full-layers", "a,b", "-o", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert result.output == "error: --full-layers: layer indices separated by commas, e.g. 3,7; got 'a,b'\n"
