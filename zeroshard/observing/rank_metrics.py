"""Figures agreed over every rank: what a step's metrics report is the slowest rank's, not one rank's."""

from __future__ import annotations

from typing import Sequence

import torch

from zeroshard.comm import host_sync
from zeroshard.comm.collectives import all_reduce

METRICS_PHASE = "metrics"
"""The ledger phase of the metrics' own collectives, so the tools can tell them from the step's."""


def slowest_rank(value: float, device: torch.device) -> float:
    """The largest `value` over every rank (collective). A step lasts as long as its slowest rank."""
    t = torch.tensor([value], dtype=torch.float32, device=device)
    all_reduce(t, op="max", phase=METRICS_PHASE)
    return float(host_sync.item(t, "step.slowest_rank", fake_value=value))


def slowest_per_step(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Step by step, the slowest rank's time, from each rank's list of step times."""
    return [max(times) for times in zip(*per_rank)]
