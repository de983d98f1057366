"""Activation memory of one training step, measured (not estimated)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def activation_bytes(model: nn.Module, forward: Callable[[], torch.Tensor], device: torch.device) -> dict:
    """Activation bytes alive after ``forward()`` and at the peak of forward + backward.

    Uses torch's MemTracker, which classifies every live storage (param, grad, activation,
    temporary, ...) through a dispatch mode and works on CPU as well as CUDA. Run one warm-up step
    first so lazily created buffers are not counted as activations.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = forward()
        after_forward = tracker.get_tracker_snapshot()
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")

    def acts(snapshot) -> int:
        return next(v for k, v in snapshot.get(device, {}).items() if str(k).endswith("ACT"))

    return {"kept_after_forward": acts(after_forward), "peak": acts(peak)}
