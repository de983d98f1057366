"""Where the runtime's own host time goes, per kind of work and per unit: `zeroshard bench --host-breakdown`.

Each stage's model is built inside ``host_clock.recording()``, so its engine times its hooks, its
reductions, its copies into the params and the sharded optimizer's step (zeroshard/runtime/host_clock.py);
after warm-up steps the clock is reset and ``steps`` steps are run. The table holds, per kind, the
host microseconds per step and per unit (per step over the engine's units: stage 3's modules, the
reduction buckets of stages 0-2) and the calls per step. At world > 1 the waits on collectives
happen inside the kinds that wait (a gather's in pre-forward, a reduction's in reduce), so there
they hold communication latency besides host work; at world 1 every collective is a local no-op.
The simulator reads its per-unit host cost from the same measurement (``unit_host_seconds``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from zeroshard.runtime import get_engine, optimizer as zs_optimizer, shard
from zeroshard.runtime.host_clock import KINDS, RUNTIME_KINDS, recording
from zeroshard.trainer.step import one_step

FORWARD_KINDS = ("pre_forward", "post_forward", "param_copy")
"""Kinds the simulator charges to a unit's forward; the rest but the optimizer go to its backward."""


def measure(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, stage: int, steps: int,
            warmup: int = 2) -> dict[str, Any]:
    """Shard ``model`` (in place) at ``stage`` with a host clock, run ``warmup`` then ``steps`` steps of
    the training step; returns ``{"units", "steps", "step_ns", "kinds": {kind: {"ns", "calls"}}}``
    with totals over the timed steps."""
    with recording():
        shard(model, stage=stage)
    opt = zs_optimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1, foreach=True)
    engine = get_engine(model)
    clock = engine.host_clock
    assert clock is not None, "built inside recording(): the engine has a clock"
    for _ in range(warmup):
        one_step(model, opt, x, y)
    clock.reset()
    start = time.perf_counter_ns()
    for _ in range(steps):
        one_step(model, opt, x, y)
    step_ns = time.perf_counter_ns() - start
    return {"units": len(engine.units), "steps": steps, "step_ns": step_ns, "kinds": clock.table()}


def rows(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind (then the runtime's own total, ``RUNTIME_KINDS``, and the whole step): microseconds per step and per unit,
    calls per step and share of the step; each the mean over ranks."""
    first = per_rank[0]
    steps, units = first["steps"], first["units"]

    def mean(get) -> float:
        return statistics.fmean(get(r) for r in per_rank)

    step_us = mean(lambda r: r["step_ns"]) / steps / 1e3
    out = []
    for kind in KINDS:
        us = mean(lambda r: r["kinds"][kind]["ns"]) / steps / 1e3
        calls = mean(lambda r: r["kinds"][kind]["calls"]) / steps
        out.append({"kind": kind, "us_per_step": us, "us_per_unit": us / units, "calls_per_step": calls,
                    "share": us / step_us if step_us else 0.0})
    runtime = [r for r in out if r["kind"] in RUNTIME_KINDS]
    total = sum(r["us_per_step"] for r in runtime)
    out.append({"kind": "runtime total", "us_per_step": total, "us_per_unit": total / units,
                "calls_per_step": sum(r["calls_per_step"] for r in runtime), "share": total / step_us if step_us else 0.0})
    out.append({"kind": "whole step", "us_per_step": step_us, "us_per_unit": step_us / units, "calls_per_step": 0.0,
                "share": 1.0})
    return out


def unit_host_seconds(result: dict[str, Any]) -> tuple[float, float]:
    """(forward, backward) host seconds per unit and micro-step from one ``measure`` result at stage
    3: what the simulator adds to each block's passes (the optimizer's share is not per unit)."""
    per = result["steps"] * result["units"] * 1e9
    fwd = sum(result["kinds"][k]["ns"] for k in FORWARD_KINDS) / per
    bwd = sum(v["ns"] for k, v in result["kinds"].items() if k in RUNTIME_KINDS and k not in FORWARD_KINDS
              and k != "optimizer") / per
    return fwd, bwd
