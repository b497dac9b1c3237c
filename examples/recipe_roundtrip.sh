#!/usr/bin/env bash
# Run a shipped recipe, then run the recipe the checkpoint carries and check that it reproduces the weights
# bit for bit.
#   bash examples/recipe_roundtrip.sh                 # svdllm k/v latent at 50% on the demo model, ~2 minutes
# Overridable: RECIPE (a file or a shipped name), OUT.
set -euo pipefail
RECIPE=${RECIPE:-svdllm-kv-latent-50}
OUT=${OUT:-out/example-recipe}

attnsurg recipe validate "$RECIPE"
attnsurg run "$RECIPE" -o "$OUT" --overwrite
attnsurg run "$OUT/attnsurg_recipe.yaml" -o "$OUT-again" --overwrite
for shard in "$OUT"/*.safetensors; do
    cmp "$shard" "$OUT-again/$(basename "$shard")"
done
echo "reproduced $OUT bit for bit from its attnsurg_recipe.yaml"
