"""Where one step's time went, from the training thread's spans and the ledger's records.

Pure functions of recorded timestamps, so they are tested on synthetic inputs.

- A collective's *exposed* time is how long the training thread blocked in its wait (the ledger's
  ``waited``). Each wait is attributed to the span it happened in: all-gather waits in forward and
  backward are "ag_wait", reduce-scatter (all-reduce at stage 0) waits in backward are "rs_wait",
  and the forward/backward figures are what is left: compute.
- ``param_sync`` (stages 1-2: all-gather of the updated shards) runs inside the optimizer span and
  is taken out of it, from the first such collective's issue to its last completion.
- *Busy* time is the union of the collectives' [start, end] intervals: end comes from the backend's
  completion callback when it has one; otherwise (gloo's reduce-scatter runs inside ``wait()``) the
  only time the collective is known to run is its wait, so that interval counts, fully exposed.
- overlap ratio = 1 - exposed / busy over the training collectives (metric and desync all-reduces
  are left out: they are blocking by design).
- On an accelerator with a device-async backend (NCCL) a wait returns at once, so the profiler times
  those waits with device events instead (zeroshard/comm/device_clock.py): ``waited`` is the compute
  stream's stall and [start, end] runs from the issue to the wait on the device. A profile's
  ``wait_clock`` says which ("host" or "device").
"""

from __future__ import annotations

from typing import Any, Iterable

PHASES = ("data", "forward", "ag_wait", "backward", "rs_wait", "optimizer", "param_sync", "checkpoint", "other")
"""Breakdown keys, in step order; each is seconds and they sum to the step's wall time."""

TRAINING_PHASES = frozenset({"forward", "backward", "recompute", "param_sync", "optimizer"})
GATHER_PHASES = frozenset({"forward", "backward", "recompute"})
REDUCE_OPS = frozenset({"reduce_scatter", "all_reduce"})


def busy_intervals(records: Iterable[Any]) -> list[tuple[float, float]]:
    out = []
    for r in records:
        end = r.end
        if end is None:
            continue
        start = r.start
        if not r.observed and r.wait_start is not None:
            start = max(start, r.wait_start)
        out.append((start, end))
    return out


def union_length(intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    current: tuple[float, float] | None = None  # the merged interval being extended
    for a, b in sorted(intervals):
        if current is None or a > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = (a, b)
        else:
            current = (current[0], max(current[1], b))
    if current is not None:
        total += current[1] - current[0]
    return total


def _span_of(t: float, spans: list[tuple]) -> str | None:
    for span in spans:
        if span[1] <= t <= span[2]:
            return span[0]
    return None


def breakdown(spans: list[tuple], records: list[Any], step_s: float) -> dict[str, float]:
    """Seconds per phase (``PHASES``) of one step lasting ``step_s``; see the module docstring."""
    span_total: dict[str, float] = {}
    for name, t0, t1, *_ in spans:
        span_total[name] = span_total.get(name, 0.0) + (t1 - t0)
    exposed = {"forward": 0.0, "backward": 0.0}
    ag_wait = rs_wait = 0.0
    for r in records:
        waited, wait_start = r.waited, r.wait_start
        if not waited or wait_start is None:
            continue
        where = _span_of(wait_start, spans)
        if where not in exposed:
            continue  # e.g. the grad-norm all-reduce inside "optimizer": part of that phase
        if r.op == "all_gather" and r.phase in GATHER_PHASES:
            ag_wait += waited
        elif r.op in REDUCE_OPS and r.phase == "backward":
            rs_wait += waited
        else:
            continue  # not the sharding runtime's traffic (a model's own collective): left in compute
        exposed[where] += waited
    sync = [r for r in records if r.phase == "param_sync"]
    param_sync = 0.0
    if sync:
        ends = [e for r in sync for e in (r.end,) if e is not None]
        if ends:
            param_sync = max(ends) - min(r.start for r in sync)
    out = {
        "data": span_total.get("data", 0.0),
        "forward": span_total.get("forward", 0.0) - exposed["forward"],
        "ag_wait": ag_wait,
        "backward": span_total.get("backward", 0.0) - exposed["backward"],
        "rs_wait": rs_wait,
        "optimizer": max(0.0, span_total.get("optimizer", 0.0) - param_sync),
        "param_sync": param_sync,
        "checkpoint": span_total.get("checkpoint", 0.0),
    }
    # Exposed waits outside the named spans (e.g. other collectives) stay in "other".
    out["other"] = max(0.0, step_s - sum(out.values()))
    return out


def comm_stats(records: list[Any]) -> dict[str, Any]:
    """Bytes, busy and exposed time of one step's collectives, and the overlap ratio."""
    training = [r for r in records if r.phase in TRAINING_PHASES]
    busy = union_length(busy_intervals(training))
    exposed = sum(r.waited for r in training)
    overlap = None if busy <= 0 else min(1.0, max(0.0, 1.0 - exposed / busy))
    return {
        "comm_bytes": sum(r.bytes for r in records),
        "comm_calls": len(records),
        "comm_busy_s": busy,
        "comm_exposed_s": min(exposed, busy) if busy > 0 else exposed,
        "overlap": overlap,
        "ag_windows": gather_windows(records),
    }


def gather_windows(records: list[Any]) -> int:
    """Unit gathers in forward/backward/recompute: consecutive all-gathers of one unit and phase
    (one per flat group) are one window."""
    windows, last = 0, None
    for r in records:
        if r.op != "all_gather" or r.phase not in GATHER_PHASES:
            continue
        key = (r.unit, r.phase)
        if key != last:
            windows += 1
        last = key
    return windows


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
