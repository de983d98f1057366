"""The one way the tools time steps on spawned ranks (``zeroshard.trainer.launch.spawn``): tune,
bench, `plan measure` and `plan calibrate` all start each timed call after a barrier, so every
rank's clock starts together, wait for the device before reading the clock (a cuda step is queued,
not done, when it returns), and report a step as long as its slowest rank."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def timed(fn: Callable[[], Any], calls: int, *, phase: str, device: Any = None) -> list[float]:
    """Seconds of each of ``calls`` calls of ``fn`` on this rank; ``phase`` names the barrier in
    the ledger, ``device`` (a torch.device) is synchronized when it is an accelerator."""
    import torch

    from zeroshard.comm import collectives

    out = []
    for _ in range(calls):
        collectives.barrier(phase=phase)
        start = time.perf_counter()
        fn()
        if device is not None and device.type != "cpu":
            torch.accelerator.current_stream(device).synchronize()
        out.append(time.perf_counter() - start)
    return out


def warm_median(fn: Callable[[], Any], repeats: int, *, phase: str, device: Any = None) -> float:
    """Median seconds of ``repeats`` calls of ``fn``, after one more that pays for allocations,
    lazy initialisation and connection setup."""
    return statistics.median(timed(fn, repeats + 1, phase=phase, device=device)[1:])


def slowest_median(per_rank: list[list[float]]) -> float | None:
    """The median over timed steps of the slowest rank's time; None when no step was timed."""
    from zeroshard.trainer.step import slowest_per_step

    steps = slowest_per_step(per_rank)
    return statistics.median(steps) if steps else None
