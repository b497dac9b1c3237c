"""Candidate MLA splits (RoPE dims : FreqFold [: latent rank]) scored by the closed form's held-out layer error.

    python benchmarks/mla_split_probe.py MODEL BUDGET ROPE:FOLD[:RANK] ... [--received]
    e.g. python benchmarks/mla_split_probe.py qwen2.5-coder-0.5b 0.5 64:1 48:1 32:2 32:1 16:4

``--received``: each split is also fitted with the calibration tokens weighted by the attention they receive
(``--token-weights received``), and both errors are printed.

Six-domain calibration, 8 windows of 512 tokens: each layer fitted (native format, consumer-weighted) on the
first 6 and scored on the last 2, on the original model's own inputs; prints the mean and worst relative
output error over layers (the first token left out) and each layer's; writes benchmarks/results/mla_split_probe.json.
"""

import sys
import time

import torch
from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.heads import received_attention
from attnsurg.calibrate import InputStatistics, attention_inputs, calibration_windows, causal_mask
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.methods import mla
import attnsurg.methods.mla.assemble  # noqa: F401  (mla.assemble)
import attnsurg.methods.mla.fit  # noqa: F401  (mla.fit)
import attnsurg.methods.mla.plan  # noqa: F401  (mla.plan)
import attnsurg.methods.mla.refine  # noqa: F401  (mla.refine)
from attnsurg.requests import TextData
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from common import write_result
args = [a for a in sys.argv[1:] if a != "--received"]
received = "--received" in sys.argv
name, budget = args[0], float(args[1])
cands = [tuple(map(int, c.split(":"))) + ((None,) if c.count(":") == 1 else ()) for c in args[2:]]
source = resolve_source(name); model, tok = load_model(source), load_tokenizer(source)
anatomy = inspect_config(model.config); family = family_for_surgery(anatomy.model_type)
windows = calibration_windows(tok, TextData(dataset="all", part="calib"), 8 * 512, 512)
fit_n = 6
t0=time.time()
inputs = attention_inputs(model, family, windows)
rotary = model.get_submodule(family.rotary_path); inv = rotary.inv_freq
pos = torch.arange(512)[None]
with torch.no_grad():
  targets = []
  for i, layer in enumerate(model.get_submodule(family.layers_path)):
    x = inputs[i][fit_n:]
    targets.append(getattr(layer, family.attention_attr)(hidden_states=x, position_embeddings=rotary(x, pos), attention_mask=causal_mask(512))[0])
  stats = []
  for i, layer in enumerate(model.get_submodule(family.layers_path)):
    x, attn = inputs[i][:fit_n], getattr(layer, family.attention_attr)
    s = InputStatistics(); s.add(x, received_attention(attn, x, rotary(x, pos)) if received else None); stats.append(s)
print("captured", time.time()-t0, flush=True)
rows = []
for rope_dim, fold, rank in cands:
  t0=time.time()
  plan = mla.plan.plan_mla(anatomy, None if rank else budget, kv_rank=rank, rope_dim=rope_dim, rope_fold=fold)
  config = mla.assemble.deepseek_config(model, plan.fitted, inv); config._attn_implementation = "sdpa"
  rope = DeepseekV3RotaryEmbedding(config)(inputs[0][:1], pos)
  for weighting in ("uniform", "received") if received else ("uniform",):
    errs = []
    with torch.no_grad():
      for i, layer in enumerate(model.get_submodule(family.layers_path)):
        attn = getattr(layer, family.attention_attr)
        w = mla.fit.fit_layer(attn, stats[i].sigma, plan, True, stats[i].sigma_first, inv,
                          stats[i].sigma_received if weighting == "received" else None)
        out = mla.refine.sampled_output(mla.refine.mla_attention(config, i, w, attn.o_proj.weight), inputs[i][fit_n:], rope, torch.arange(512))
        t = targets[i]
        errs.append(float((out - t)[:, 1:].pow(2).sum() / t[:, 1:].pow(2).sum()))
    print(f"rope {rope_dim} fold {fold} latent {plan.kv_rank} {weighting}: mean {sum(errs)/len(errs):.4f} max {max(errs):.3f} "
          f"{time.time()-t0:.1f}s", " ".join(f"{e:.2f}" for e in errs), flush=True)
    rows.append({"rope_dim": rope_dim, "rope_fold": fold, "kv_rank": plan.kv_rank, "token_weights": weighting,
                 "mean": sum(errs) / len(errs), "layers": errs})
write_result("mla_split_probe", {"model": name, "kv_budget": budget, "rows": rows})
