"""Where a native-format MLA conversion loses on a model with q/k/v biases: per layer, the closed form's
relative attention-output error on held-out calibration windows, with the constant 1 each bias rides on
computed exactly or, as the native format must, from the input (t = a . x) one place at a time.

    python benchmarks/mla_bias_probe.py [--model qwen2.5-coder-0.5b] [--kv-budget 0.5] [--windows 12]

Each layer is fitted on the first windows (six-domain calibration, 512 tokens each) and scored on the last
quarter, every layer on the original model's own inputs (no drift carried). Columns:
- exact: the exact format (constant channel C, query and key biases, o bias);
- t in q: only the query bias rides on a . x;
- t in k_rope: only the RoPE key's bias does;
- t in latent: only the latent norm divides the latent by a . x;
- native: all three (what the native format computed before RoPE key biases were shrunk);
- k ridge R: the RoPE key's bias alone on a direction fitted with ridge R (the latent channel's is 1.0);
- k drop w<F: the RoPE key's bias dropped on pairs rotating slower than F, folded whole on the others;
- k shrink LN / native shrink LN: the bias shrunk per pair (``mla.fit.rope_bias_shrinkage``) over a span of N
  tokens, alone and with the query and latent folds (what the native format computes now at N = 1024);
- k drop: the RoPE key's bias dropped everywhere;
- "@1" columns: the same error at the second token of every window alone (the first a prompt's answer sees);
- shipped ridge R: the native closed form as written (RoPE key bias shrunk, dominance 32) through the DeepseekV3
  attention module, its constant direction fitted at ridge R (``mla.fit.CONSTANT_RIDGES``), and a . x at the
  second token with that direction;
- the share of the layer's output energy the value bias (constant) carries, and the spread of a . x.
Writes benchmarks/results/mla_bias_probe.json.
"""

from __future__ import annotations

import argparse

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, apply_rotary_pos_emb_interleave

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import InputStatistics, attention_inputs, calibration_windows, causal_mask
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.methods import mla
import attnsurg.methods.mla.assemble  # noqa: F401  (mla.assemble)
import attnsurg.methods.mla.fit  # noqa: F401  (mla.fit)
import attnsurg.methods.mla.plan  # noqa: F401  (mla.plan)
from attnsurg.methods.mla.refine import mla_attention, sampled_output
from attnsurg.requests import TextData
from common import write_result


def direction(sigma: torch.Tensor, sigma_first: torch.Tensor, ridge: float) -> torch.Tensor:
    D = sigma.shape[0] - 1
    gram, target = sigma[:D, :D] + sigma_first[:D, :D], sigma[:D, D] + sigma_first[:D, D]
    return torch.linalg.solve(gram + ridge * gram.diagonal().mean() * torch.eye(D, dtype=gram.dtype), target)


def layer_output(w: mla.fit.MLAWeights, o_weight: torch.Tensor, o_bias: torch.Tensor | None, plan: mla.plan.MLAPlan,
                 x: torch.Tensor, rope, t: torch.Tensor, where: set[str], tk: torch.Tensor | None = None) -> torch.Tensor:
    """An exact-format layer's output with the constant 1 replaced by ``t`` (per token) in ``where``."""
    n, L, D = x.shape
    H, R, r = plan.num_heads, plan.rope_dim, plan.kv_rank
    nope, d = plan.qk_nope_dim, plan.head_dim
    one = torch.ones_like(t)
    q = x @ w.q_proj.T + (t if "q" in where else one)[..., None] * w.q_bias
    q = q.view(n, L, H, nope + R).transpose(1, 2)
    q_pass, q_rot = q.split([nope, R], dim=-1)
    latent = (x @ w.kv_a_weight[:r].T) / (t if "latent" in where else one)[..., None] + w.kv_a_bias[:r]
    tk = (t if "k" in where else one) if tk is None else tk
    tk = tk[..., None] if tk.ndim == t.ndim else tk
    k_rot = x @ w.kv_a_weight[r + 1:].T + tk * w.kv_a_bias[r + 1:]
    cos, sin = rope
    q_rot, _ = apply_rotary_pos_emb_interleave(q_rot, q_rot[:, :1], cos, sin)
    _, k_rot = apply_rotary_pos_emb_interleave(k_rot[:, None], k_rot[:, None], cos, sin)
    kv = (latent @ w.kv_b_proj[:, :r].T).view(n, L, H, nope + d).transpose(1, 2)
    k_pass, v = kv.split([nope, d], dim=-1)
    keys = torch.cat([k_pass, k_rot.expand(n, H, L, R)], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(torch.cat([q_pass, q_rot], -1), keys, v, is_causal=True,
                                                           scale=(nope + R) ** -0.5)
    out = out.transpose(1, 2).reshape(n, L, H * d) @ o_weight.T
    return out + (o_bias if o_bias is not None else 0)


def shipped_output(w: mla.fit.MLAWeights, o_weight: torch.Tensor, plan: mla.plan.MLAPlan, config, x: torch.Tensor,
                   rope) -> torch.Tensor:
    """A closed form's output through the DeepseekV3 attention module it is written as (float64)."""
    attention = mla_attention(config, 0, w, o_weight).double()
    return sampled_output(attention, x, rope, torch.arange(x.shape[1]))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b)[:, 1:].pow(2).sum() / b[:, 1:].pow(2).sum())  # the sink token apart


def relative_at(a: torch.Tensor, b: torch.Tensor, position: int) -> float:
    """The relative error at one position of every window (position 1: the second token of a prompt)."""
    return float((a - b)[:, position].pow(2).sum() / b[:, position].pow(2).sum())


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--kv-budget", type=float, default=0.5)
    parser.add_argument("--rope-dim", type=int, default=None)
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--layers", type=int, nargs="*", default=None)
    args = parser.parse_args()

    source = resolve_source(args.model)
    model, tokenizer = load_model(source), load_tokenizer(source)
    anatomy = inspect_config(model.config)
    family = family_for_surgery(anatomy.model_type)
    plan = mla.plan.plan_mla(anatomy, args.kv_budget, rope_dim=args.rope_dim, format="exact")
    windows = calibration_windows(tokenizer, TextData(dataset="all", part="calib"), args.windows * 512, 512)
    fit_n = len(windows) - max(1, len(windows) // 4)
    inputs = attention_inputs(model, family, windows)
    config = mla.assemble.deepseek_config(model, plan, model.get_submodule(family.rotary_path).inv_freq)
    positions = torch.arange(512)[None]
    rope = tuple(t.double() for t in DeepseekV3RotaryEmbedding(config)(inputs[0][:1], positions))
    rotary = model.get_submodule(family.rotary_path)
    rows = []
    variants = {"exact": set(), "t in q": {"q"}, "t in k_rope": {"k"}, "t in latent": {"latent"},
                "native": {"q", "k", "latent"}}
    for index, layer in enumerate(model.get_submodule(family.layers_path)):
        attn = getattr(layer, family.attention_attr)
        if args.layers and index not in args.layers:
            continue
        stats = InputStatistics()
        stats.add(inputs[index][:fit_n])
        w = mla.fit.fit_layer(attn, stats.sigma, plan, True, stats.sigma_first)
        held = inputs[index][fit_n:]
        cos, sin = rotary(held, positions)
        target = attn(hidden_states=held, position_embeddings=(cos, sin),
                      attention_mask=causal_mask(512))[0].double()
        a = mla.fit.constant_direction(stats.sigma, stats.sigma_first)
        x = held.double()
        t = x @ a
        o_weight, o_bias = attn.o_proj.weight.double(), w.o_bias
        row = {"layer": index}
        for name, where in variants.items():
            out = layer_output(w, o_weight, o_bias, plan, x, rope, t, where)
            row[name] = relative(out, target)
            row[f"{name} @1"] = relative_at(out, target, 1)
        vb = attn.v_proj.bias
        value_bias = o_weight @ torch.cat([vb.double().view(plan.num_kv_heads, -1)[h // (plan.num_heads // plan.num_kv_heads)]
                                           for h in range(plan.num_heads)]) if vb is not None else torch.zeros(1)
        row["value bias share"] = float(value_bias.pow(2).sum() * target.shape[0] * (target.shape[1] - 1)
                                        / target[:, 1:].pow(2).sum())
        for ridge in (1e-4, 1e-3, 1e-2, 1e-1):
            tk = x @ direction(stats.sigma, stats.sigma_first, ridge)
            row[f"k ridge {ridge:g}"] = relative(layer_output(w, o_weight, o_bias, plan, x, rope, t, set(), tk), target)
        freqs = torch.tensor(mla.fit.rope_frequencies(plan, model.get_submodule(family.rotary_path).inv_freq),
                             dtype=torch.float64).repeat_interleave(2)
        for limit in (1e-1, 1e-2, 1e-3, 1e-4):
            tk = torch.where(freqs < limit, 0.0, t[..., None])
            row[f"k drop w<{limit:g}"] = relative(layer_output(w, o_weight, o_bias, plan, x, rope, t, set(), tk), target)
        var = float(t[:, 1:].var())
        for span in (128, 512, 1024, 2048):
            beta = mla.fit.rope_bias_shrinkage(freqs[0::2], var, span)
            row[f"k shrink L{span}"] = relative(layer_output(w, o_weight, o_bias, plan, x, rope, t, set(), beta * t[..., None]), target)
            row[f"native shrink L{span}"] = relative(layer_output(w, o_weight, o_bias, plan, x, rope, t, {"q", "latent"}, beta * t[..., None]), target)
        native = mla.plan.plan_mla(anatomy, args.kv_budget, rope_dim=args.rope_dim)
        native_config = mla.assemble.deepseek_config(model, native, model.get_submodule(family.rotary_path).inv_freq)
        native_config._attn_implementation = "sdpa"
        native_rope = tuple(t.double() for t in DeepseekV3RotaryEmbedding(native_config)(inputs[0][:1], positions))
        for ridge in mla.fit.constant_ridges():
            shipped = mla.fit.fit_layer(attn, stats.sigma, native, True, stats.sigma_first, rotary.inv_freq, ridge=ridge)
            out = shipped_output(shipped, o_weight, native, native_config, x, native_rope)
            row[f"shipped ridge {ridge:g}"], row[f"shipped ridge {ridge:g} @1"] = relative(out, target), relative_at(out, target, 1)
            row[f"a.x @1 ridge {ridge:g}"] = float((x[:, 1] @ mla.fit.constant_direction(stats.sigma, stats.sigma_first, ridge)).mean())
        row["k drop"] = relative(layer_output(w, o_weight, o_bias, plan, x, rope, t, set(), torch.zeros_like(t)), target)
        row["a.x spread"] = float((t[:, 1:] - 1).pow(2).mean().sqrt())
        row["a.x min"] = float(t[:, 1:].min())
        row["a.x @0"], row["a.x @1"] = float(t[:, 0].mean()), float(t[:, 1].mean())
        rows.append(row)
        print(" | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    write_result("mla_bias_probe", {"model": args.model, "kv_budget": args.kv_budget, "plan": str(plan), "rows": rows})


if __name__ == "__main__":
    main()
