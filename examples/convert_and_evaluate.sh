#!/usr/bin/env bash
# Convert the demo model's attention to MLA at half of its KV cache, then compare the original and the result
# side by side: perplexity on six text domains (KV bytes per token, parameters), then facts, cloze and passkey.
#   bash examples/convert_and_evaluate.sh            # the demo model, ~15 minutes on 2 cores
# Overridable: MODEL, OUT, CALIB (calibration options), EVAL (eval perplexity text options), TASKS (eval tasks options).
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
OUT=${OUT:-out/example-mla-50}
CALIB=${CALIB:---calib-dataset wiki-sample}
EVAL=${EVAL:---dataset all --max-tokens 2048}
TASKS=${TASKS:---tasks facts,cloze,passkey}

attnsurg info "$MODEL"
attnsurg convert "$MODEL" --to mla --kv-budget 0.5 -o "$OUT" --overwrite $CALIB
attnsurg info "$OUT"
attnsurg eval perplexity "$MODEL" "$OUT" $EVAL
attnsurg eval tasks "$MODEL" "$OUT" $TASKS
