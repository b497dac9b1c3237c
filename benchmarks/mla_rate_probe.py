"""How far the converted residual stream drifts from the original's after the first K refined MLA layers, at
each refinement learning rate: a candidate signal for choosing the rate per model.

    python benchmarks/mla_rate_probe.py MODEL BUDGET K [LR ...]
    e.g. python benchmarks/mla_rate_probe.py qwen2.5-coder-0.5b 0.5 8 1e-3 2.5e-4

The default conversion's set-up (six-domain calibration, 4096 tokens in windows of 512, refinement on the first
2048 with a quarter as many held out, the rate backoff): after each of the first K layers, prints the held-out
windows' relative stream error ||h' - h||^2 / ||h||^2; writes benchmarks/results/mla_rate_probe.json.
"""

import math
import sys
import time

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import calibration_windows, input_statistics
from attnsurg.io.load import load_model, load_tokenizer, resolve_source
from attnsurg.methods import mla
import attnsurg.methods.mla.assemble  # noqa: F401  (mla.assemble)
import attnsurg.methods.mla.fit  # noqa: F401  (mla.fit)
import attnsurg.methods.mla.plan  # noqa: F401  (mla.plan)
import attnsurg.methods.mla.refine  # noqa: F401  (mla.refine)
from attnsurg.requests import TextData

from common import write_result

name, budget, depth = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
rates = [float(a) for a in sys.argv[4:]] or [1e-3, 2.5e-4]
source = resolve_source(name)
model, tokenizer = load_model(source), load_tokenizer(source)
anatomy = inspect_config(model.config)
family = family_for_surgery(anatomy.model_type)
windows = calibration_windows(tokenizer, TextData(dataset="all", part="calib"), 4096, 512)
plan = mla.plan.plan_mla(anatomy, budget)
attentions = [getattr(layer, family.attention_attr) for layer in model.get_submodule(family.layers_path)]
statistics = input_statistics(model, attentions, windows)
inv_freq = model.get_submodule(family.rotary_path).inv_freq
config = mla.assemble.deepseek_config(model, plan.fitted, inv_freq)
config._attn_implementation = "sdpa"
keep = mla.refine.Refinement.tokens // windows.shape[1]
held = math.ceil(keep * mla.refine.HELD_OUT_SHARE)
embeddings = model.get_input_embeddings()(windows[: keep + held]).float()
forms = [mla.fit.layer_closed_forms(a, s, plan, True, inv_freq) for a, s in zip(attentions[:depth], statistics[:depth])]
rows = []
for lr in rates:
    started = time.perf_counter()
    refiner = mla.refine.SequentialRefiner(model.get_submodule(family.rotary_path), family, embeddings.clone(), config, held)
    drift = []
    for index, (w, *alternatives) in enumerate(forms):
        refiner.refine(index, model.get_submodule(f"{family.layers_path}.{index}"), w, mla.refine.Refinement(lr=lr), alternatives)
        original = refiner.original[keep:]
        drift.append(float((refiner.stream[keep:] - original).pow(2).sum() / original.pow(2).sum()))
    print(f"{name} lr {lr:g}:", " ".join(f"{e:.4f}" for e in drift), f"{time.perf_counter() - started:.0f} s", flush=True)
    rows.append({"lr": lr, "stream_error": drift})
write_result("mla_rate_probe", {"model": name, "kv_budget": budget, "layers": depth, "rows": rows})
