"""Does accelerate shard with FSDP on CPU processes? Two processes under torchrun with ACCELERATE_USE_FSDP=true
print the distributed type accelerate gives them (FSDP, or MULTI_CPU when it falls back to plain DDP).

    python benchmarks/fsdp_on_cpu.py

Why it matters: multi-process healing is tested on CPU with DDP; FSDP can be tested only where accelerate
turns it on (benchmarks/gpu_check.sh step 5 runs it on a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys


def worker() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    print(f"process {accelerator.process_index} of {accelerator.num_processes}: {accelerator.distributed_type}")


def main() -> None:
    environment = {**os.environ, "ACCELERATE_USE_FSDP": "true", "ATTNSURG_FSDP_PROBE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__],
                          env=environment, capture_output=True, text=True, check=False)
    print("\n".join(sorted(line for line in done.stdout.splitlines() if line.startswith("process"))) or done.stderr[-2000:])


if __name__ == "__main__":
    worker() if os.environ.get("ATTNSURG_FSDP_PROBE") else main()
