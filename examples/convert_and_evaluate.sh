#!/usr/bin/env bash
# Convert the demo model's attention to MLA at half of its KV cache, then compare the original and the result
# side by side (perplexity, KV bytes per token, parameters, speed).
#   bash examples/convert_and_evaluate.sh            # the demo model, ~4 minutes on 2 cores
# Overridable: MODEL, OUT, CALIB (calibration options), EVAL (eval perplexity text options).
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
OUT=${OUT:-out/example-mla-50}
CALIB=${CALIB:---calib-dataset wiki-sample}
EVAL=${EVAL:---dataset wiki-sample --max-tokens 4096}

attnsurg info "$MODEL"
attnsurg convert "$MODEL" --to mla --kv-budget 0.5 -o "$OUT" --overwrite $CALIB
attnsurg info "$OUT"
attnsurg eval perplexity "$MODEL" "$OUT" $EVAL
