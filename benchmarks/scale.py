"""Surgery at real shapes: wall time, peak memory, output size and per-layer time on synthetic checkpoints.

    python benchmarks/scale.py [llama-3.2-1b llama-3.1-8b qwen2.5-7b] [--layers N] [--methods mla,svdllm]
                               [--calib-tokens 1024] [--work-dir out/scale] [--device auto]

Each model's checkpoint is made by benchmarks/synthetic_checkpoint.py (random bf16 weights with the real
config; ``--layers`` keeps the first N layers). Each method runs as its own `attnsurg` process with
`--eval-tokens 0` (cost only: random weights have no quality to measure): `convert --to mla --kv-budget 0.5
--stream` and `compress --method svdllm --ratio 0.5 --stream` (each one source layer in memory at a time).
Peak memory is the process's peak resident set; per-layer
time is the surgery's own time (calibration, fit and refinement; not loading or writing) over the layers.
Prints one markdown table and writes results/scale.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_checkpoint import CONFIGS, write_checkpoint  # noqa: E402
from common import write_result  # noqa: E402  (benchmarks/ is on the path when a script runs)

COMMANDS = {
    "mla": ["convert", "--to", "mla", "--kv-budget", "0.5", "--stream"],
    "svdllm": ["compress", "--method", "svdllm", "--ratio", "0.5", "--stream"],
}


def checkpoint_for(name: str, layers: int | None, work_dir: Path) -> Path:
    import torch

    path = work_dir / (name + (f"-{layers}l" if layers else ""))
    if not (path / "config.json").is_file():
        write_checkpoint(name, path, torch.bfloat16, layers, "2GB")
    return path


def gigabytes(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9


def run_method(checkpoint: Path, method: str, calib_tokens: int, output: Path, device: str = "auto") -> dict:
    """One surgery in a child process: its JSON report, wall time and peak resident set."""
    command = [sys.executable, "-m", "attnsurg", "--quiet", *COMMANDS[method][:1], str(checkpoint),
               *COMMANDS[method][1:], "-o", str(output), "--overwrite", "--eval-tokens", "0",
               "--calib-tokens", str(calib_tokens), "--calib-dataset", "wiki-sample", "--device", device, "--json"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    return {"seconds": seconds, "surgery_seconds": report.get("convert_seconds") or report.get("factorize_seconds"),
            "peak_rss_gb": report["peak_memory_gb"], "output_gb": gigabytes(output)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["llama-3.2-1b"], choices=sorted(CONFIGS))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--methods", default="mla,svdllm")
    parser.add_argument("--calib-tokens", type=int, default=1024)
    parser.add_argument("--work-dir", type=Path, default=Path("out/scale"))
    parser.add_argument("--device", default="auto", help="where calibration and refinement run (auto, cpu, cuda)")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        checkpoint = checkpoint_for(name, args.layers, args.work_dir)
        layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
        for method in args.methods.split(","):
            measured = run_method(checkpoint, method, args.calib_tokens, args.work_dir / f"{checkpoint.name}-{method}",
                                  args.device)
            per_layer = (measured["surgery_seconds"] or 0) / layers
            rows.append({"model": checkpoint.name, "method": method, "device": args.device, "layers": layers,
                         "source_gb": gigabytes(checkpoint),
                         **measured, "seconds_per_layer": per_layer})
    print("| model | method | device | source GB | wall s | surgery s per layer | peak RSS GB | output GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['method']} | {r['device']} | {r['source_gb']:.2f} | {r['seconds']:.0f} | {r['seconds_per_layer']:.1f} | "
              f"{r['peak_rss_gb']:.2f} | {r['output_gb']:.2f} |")
    write_result("scale", rows)


if __name__ == "__main__":
    main()
