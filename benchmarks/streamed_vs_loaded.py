"""The same surgery loaded and streamed (`--stream`): are the written tensors the same, and what does each cost?

    python benchmarks/streamed_vs_loaded.py [MODEL] -- compress --method tucker --ratio 0.5
    python benchmarks/streamed_vs_loaded.py out/synthetic/llama-3.2-1b -- convert --to mla

Runs `attnsurg COMMAND MODEL ARGS -o DIR` twice in child processes (`--eval-tokens 0`: nothing scored), without
and with `--stream`, then compares every tensor of the two checkpoints: names, shapes, how many are bit-identical
and the largest difference relative to the tensor's own largest value. Prints wall time and peak resident memory
of each run (from the JSON report).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open


def run(model: str, command: list[str], output: Path, streamed: bool) -> dict:
    args = [sys.executable, "-m", "attnsurg", "--quiet", command[0], model, *command[1:], "--eval-tokens", "0",
            "-o", str(output), "--overwrite", "--json", *(["--stream"] if streamed else [])]
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return {"seconds": time.perf_counter() - start, "peak_rss_gb": json.loads(done.stdout)["peak_memory_gb"]}


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(directory.glob("model*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found.update({name: f.get_tensor(name) for name in f.keys()})
    return found


def compare(loaded: dict[str, torch.Tensor], streamed: dict[str, torch.Tensor]) -> dict:
    if loaded.keys() != streamed.keys():
        return {"same_names": False, "only_loaded": sorted(loaded.keys() - streamed.keys())[:5],
                "only_streamed": sorted(streamed.keys() - loaded.keys())[:5]}
    shapes = [name for name in loaded if loaded[name].shape != streamed[name].shape]
    if shapes:
        return {"same_names": True, "shape_mismatches": shapes[:5]}
    worst, where = 0.0, None
    for name, a in loaded.items():
        a, b = a.double(), streamed[name].double()
        difference = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30)) if a.numel() else 0.0
        if difference > worst:
            worst, where = difference, name
    identical = sum(torch.equal(a, streamed[name]) for name, a in loaded.items())
    return {"same_names": True, "tensors": len(loaded), "bit_identical": identical,
            "largest_relative_difference": worst, "at": where}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the attnsurg command and its options")
    parser.add_argument("--work-dir", type=Path, default=Path("out/streamed_vs_loaded"))
    options = parser.parse_args()
    command = [part for part in options.command if part != "--"] or ["compress", "--method", "tucker", "--ratio", "0.5"]
    costs = {}
    for mode in ("loaded", "streamed"):
        costs[mode] = run(options.model, command, options.work_dir / mode, mode == "streamed")
    result = {"command": command, "model": options.model, **costs,
              **compare(tensors(options.work_dir / "loaded"), tensors(options.work_dir / "streamed"))}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
