"""Per-layer progress of a streamed run, read from its checkpoint (``io/resume.py``) as each layer finishes.

    python benchmarks/stream_progress.py OUT.stream-state [--pid PID] [--every 20]

Prints one line per finished decoder layer: the clock, the layers done, the seconds since the previous line
and, with ``--pid``, that process's resident memory. Stops when the state directory is gone (the run
completed and was renamed into place).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from safetensors import SafetensorError, safe_open

from attnsurg.io.resume import CHECKPOINT_FILE


def layers_done(state: Path) -> int | None:
    try:
        with safe_open(str(state / CHECKPOINT_FILE), framework="pt") as f:
            return json.loads(f.metadata()["progress"])["next_layer"]
    except (OSError, SafetensorError, KeyError, ValueError):
        return None


def resident_gb(pid: int) -> float:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * 4096 / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("state", type=Path)
    parser.add_argument("--pid", type=int, default=None)
    parser.add_argument("--every", type=float, default=20.0)
    options = parser.parse_args()
    last, since = None, None
    while options.state.is_dir():
        done = layers_done(options.state)
        if done is not None and done != last:
            now = time.time()
            memory = f" rss {resident_gb(options.pid):.2f} GB" if options.pid else ""
            step = f" (+{now - since:.0f} s)" if since is not None else ""
            print(f"{time.strftime('%H:%M:%S')} layers done {done}{step}{memory}", flush=True)
            last, since = done, now
        time.sleep(options.every)


if __name__ == "__main__":
    main()
