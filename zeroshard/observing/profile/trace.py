"""Chrome / Perfetto trace of one rank (``--trace``): a compute lane and a collectives lane.

Open ``RUN_DIR/trace/rank-R.json`` in https://ui.perfetto.dev or chrome://tracing; load several
ranks' files together to line them up (timestamps are ``perf_counter`` microseconds, one clock for
every process of a machine).

- Compute lane: each step, its phases (data, forward, backward, optimizer, checkpoint) and, nested
  inside them, the waits where the thread blocked on a collective (exposed communication).
- Collectives lane: each collective from issue to completion. Collectives in flight at the same
  time (a prefetch during a reduce-scatter) go to extra lanes, because complete ("X") events on one
  lane must nest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_EVENTS = 500_000
"""Beyond this many events a long run stops tracing (the file stays loadable)."""


def _us(t: float) -> float:
    return round(t * 1e6, 3)


class TraceWriter:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self._lane_ends: list[float] = []
        self.truncated = False

    def _x(self, name: str, tid: int, t0: float, t1: float, cat: str, args: dict | None = None) -> None:
        event = {"name": name, "ph": "X", "pid": self.rank, "tid": tid, "ts": _us(t0),
                 "dur": max(0.0, _us(t1) - _us(t0)), "cat": cat}
        if args:
            event["args"] = args
        self.events.append(event)

    def add_step(self, step: int, t0: float, t1: float, spans: list[tuple], records: list[Any],
                 profile: dict | None = None) -> None:
        if len(self.events) > MAX_EVENTS:
            self.truncated = True
            return
        self._x(f"step {step}", 0, t0, t1, "step", profile)
        for name, a, b in spans:
            self._x(name, 0, a, b, "phase")
        for r in records:
            if r.waited and r.wait_start is not None:
                self._x(f"wait {r.op} {r.unit or r.phase}", 0, r.wait_start, r.wait_start + r.waited, "wait",
                        {"seq": r.seq, "phase": r.phase})
        for r in sorted(records, key=lambda r: r.start):
            if r.end is None:
                continue
            lane = next((i for i, end in enumerate(self._lane_ends) if end <= r.start), None)
            if lane is None:
                lane = len(self._lane_ends)
                self._lane_ends.append(r.end)
            self._lane_ends[lane] = r.end
            self._x(f"{r.op} {r.unit or r.phase}", 1 + lane, r.start, r.end, "collective",
                    {"seq": r.seq, "bytes": r.bytes, "numel": r.numel, "dtype": r.dtype, "group": r.group,
                     "phase": r.phase, "exposed_ms": round(r.waited * 1e3, 3),
                     "end_from": "completion callback" if r.observed else "wait"})

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "compute"}}]
        for lane in range(max(1, len(self._lane_ends))):
            name = "collectives" if lane == 0 else f"collectives (overlapping {lane + 1})"
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1 + lane, "args": {"name": name}})
        payload = {"traceEvents": meta + self.events, "displayTimeUnit": "ms",
                   "otherData": {"truncated": self.truncated}}
        path.write_text(json.dumps(payload))
        return path
