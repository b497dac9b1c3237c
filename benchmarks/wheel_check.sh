#!/usr/bin/env bash
# Build the wheel, install it into a clean virtual environment (no source tree on the path) and run the demo:
# convert the built-in model to MLA at half its KV cache and score it on six domains.
#   bash benchmarks/wheel_check.sh [WORK_DIR]        # default /tmp/attnsurg-wheel-check; about 5 minutes on 2 cores
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/attnsurg-wheel-check}
rm -rf "$WORK" && mkdir -p "$WORK"
python3 -m pip wheel --no-deps --wheel-dir "$WORK/dist" "$ROOT" >/dev/null 2>&1 || python3 -m build --wheel --outdir "$WORK/dist" "$ROOT"
python3 -m venv "$WORK/venv"
. "$WORK/venv/bin/activate"
pip install -q torch==2.13.0
pip install -q "$WORK"/dist/attnsurg-*.whl
cd "$WORK"  # away from the source tree, so only the installed wheel is importable
python -c "import attnsurg, pathlib; assert 'site-packages' in pathlib.Path(attnsurg.__file__).as_posix(), attnsurg.__file__"
attnsurg --version
attnsurg recipe list
attnsurg convert smollm2-135m --to mla --kv-budget 0.5 -o out/smollm2-mla50 --overwrite
attnsurg eval perplexity smollm2-135m out/smollm2-mla50 --dataset all --max-tokens 2048
echo "wheel check passed: $(ls "$WORK"/dist)"
