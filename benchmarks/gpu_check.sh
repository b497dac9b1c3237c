#!/usr/bin/env bash
# The checks for the day a CUDA GPU is lent, as one script (about 10 minutes on one H200):
#   1. the CUDA tests (tests/test_placement.py: statistics and the MLA conversion on cuda equal the CPU's);
#   2. the demo conversion (convert smollm2-135m --to mla) on cuda and on cpu: time and ppl side by side;
#   3. an 8B-shaped streamed conversion and svdllm compression of 2 layers on cuda (benchmarks/scale.py);
#   4. healing throughput in bf16 on cuda (tokens/s from the heal report);
#   5. the same heal under FSDP (accelerate launch --use_fsdp, one process per GPU): accelerate turns FSDP on only
#      for GPU process groups (ACCELERATE_USE_FSDP leaves CPU processes as MULTI_CPU), so this is its only run.
# Every result goes to ${OUT:-out/gpu_check}; run from the repository root after the README's set-up.
set -euo pipefail
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"

echo "== 1. CUDA tests"
python -m pytest -q tests/test_placement.py 2>&1 | tee "$OUT/tests.txt"

echo "== 2. demo conversion, cuda then cpu"
python -m attnsurg assets fetch smollm2-135m wiki-sample c4-sample code-sample technical-sample multilingual-sample stories-sample
for device in cuda cpu; do
  python -m attnsurg --quiet convert smollm2-135m --to mla --kv-budget 0.5 --device "$device" \
    -o "$OUT/mla-50-$device" --overwrite --json > "$OUT/convert-$device.json"
done
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for device in ("cuda", "cpu"):
    r = json.load(open(f"{out}/convert-{device}.json"))
    worst = r["domains"]["worst"]
    print(f"{device}: convert {r['convert_seconds']:.1f} s, ppl x{r['ppl_after'] / r['ppl_before']:.4f}, worst {worst} "
          f"x{r['domains']['scores'][worst]['ratio']:.4f}")
PY

echo "== 3. 8B shapes on cuda (2 layers)"
python benchmarks/scale.py llama-3.1-8b --layers 2 --device cuda --work-dir "$OUT/scale" | tee "$OUT/scale.txt"

echo "== 4. healing throughput, bf16 on cuda"
python -m attnsurg --quiet heal "$OUT/mla-50-cuda" --teacher smollm2-135m --tokens 65536 --seq-len 1024 \
  --device cuda -o "$OUT/healed" --overwrite --json > "$OUT/heal.json"
python -c "import json; r = json.load(open('$OUT/heal.json')); h = r['heal']; print('heal:', h['tokens_per_second'], 'tokens/s,', h['steps'], 'steps')"

echo "== 5. healing under FSDP (one process per GPU)"
accelerate launch --use_fsdp --fsdp_version 2 --num_processes "$(nvidia-smi -L | wc -l)" -m attnsurg --quiet heal \
  "$OUT/mla-50-cuda" --teacher smollm2-135m --tokens 16384 --seq-len 1024 --device cuda -o "$OUT/healed-fsdp" \
  --overwrite --json > "$OUT/heal-fsdp.json"
python -c "import json; r = json.load(open('$OUT/heal-fsdp.json')); h = r['heal']; print('heal under FSDP:', h['tokens_per_second'], 'tokens/s,', h['steps'], 'steps')"
