"""Where the work runs: a module moved to the compute device for a while, and back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def on_device(module: nn.Module, device: torch.device | str | None) -> Iterator[nn.Module]:
    """``module`` on ``device`` inside the block, back where it was after (weights live on the CPU between
    uses; ``None`` or the device it is on already: nothing moves)."""
    home = next(module.parameters(), torch.empty(0)).device
    target = torch.device(device) if device is not None else home
    if target == home:
        yield module
        return
    module.to(target)
    try:
        yield module
    finally:
        module.to(home)
