#!/usr/bin/env bash
# MLA at a quarter of the KV cache, then healing by distillation from the original model.
#   bash examples/heal_mla.sh                         # 100K training tokens: ~20 minutes on 2 CPU cores
# Overridable: MODEL, OUT, TOKENS (training tokens), CALIB, HEAL (extra heal options).
# An interrupted heal resumes from "$OUT-healed.heal-state" when started again with the same options.
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
OUT=${OUT:-out/example-mla-25}
TOKENS=${TOKENS:-100000}
CALIB=${CALIB:---calib-dataset wiki-sample}
HEAL=${HEAL:---eval-every 48 --eval-tokens 4096}

attnsurg convert "$MODEL" --to mla --kv-budget 0.25 -o "$OUT" --overwrite $CALIB
attnsurg heal "$OUT" --teacher "$MODEL" -o "$OUT-healed" --tokens "$TOKENS" --overwrite $HEAL
