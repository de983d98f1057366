"""Per-rank record of every collective this process issued.

Tests count bytes from it, the profiler reads durations from it and the doctor compares it across
ranks, so it is the one source of truth about communication. It is a bounded ring buffer: a long
run keeps the newest entries plus running totals that never roll off.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time


class CollectiveState(enum.Enum):
    SCHEDULED = "scheduled"
    STARTED = "started"
    COMPLETED = "completed"


@dataclasses.dataclass
class CollectiveRecord:
    """One collective call as this rank saw it.

    ``numel``/``bytes`` describe the *full* (unsharded) extent that the collective moves: the input of
    an all-reduce or reduce-scatter and the output of an all-gather. That makes the per-step totals
    directly comparable with the textbook volumes (Ψ for all-reduce, Ψ + Ψ for reduce-scatter plus
    all-gather).
    """

    seq: int
    group: str
    op: str
    numel: int
    dtype: str
    bytes: int
    unit: str
    phase: str
    start: float
    end: float | None = None
    state: CollectiveState = CollectiveState.SCHEDULED

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["state"] = self.state.value
        return out


class Ledger:
    """Bounded ring buffer of :class:`CollectiveRecord` plus totals that survive eviction."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self.records: collections.deque[CollectiveRecord] = collections.deque(maxlen=capacity)
        self._next_seq = 0
        self._bytes_by_op: collections.Counter[str] = collections.Counter()
        self._calls_by_op: collections.Counter[str] = collections.Counter()

    def open(self, *, group: str, op: str, numel: int, dtype, elem_size: int, unit: str, phase: str) -> CollectiveRecord:
        record = CollectiveRecord(
            seq=self._next_seq,
            group=group,
            op=op,
            numel=numel,
            dtype=str(dtype).removeprefix("torch."),
            bytes=numel * elem_size,
            unit=unit,
            phase=phase,
            start=time.perf_counter(),
            state=CollectiveState.STARTED,
        )
        self._next_seq += 1
        self._bytes_by_op[op] += record.bytes
        self._calls_by_op[op] += 1
        self.records.append(record)
        return record

    @staticmethod
    def close(record: CollectiveRecord) -> None:
        if record.state is not CollectiveState.COMPLETED:
            record.end = time.perf_counter()
            record.state = CollectiveState.COMPLETED

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def total_bytes(self, op: str | None = None) -> int:
        """Bytes issued since the ledger was created (or reset), all ops or one op."""
        if op is None:
            return sum(self._bytes_by_op.values())
        return self._bytes_by_op[op]

    def calls(self, op: str | None = None) -> int:
        if op is None:
            return sum(self._calls_by_op.values())
        return self._calls_by_op[op]

    def since(self, seq: int) -> list[CollectiveRecord]:
        """Records with sequence number >= ``seq`` that are still in the buffer."""
        return [r for r in self.records if r.seq >= seq]

    def in_flight(self) -> list[CollectiveRecord]:
        return [r for r in self.records if r.state is not CollectiveState.COMPLETED]

    def reset(self) -> None:
        """Forget records and totals; sequence numbers keep counting so they stay unique."""
        self.records.clear()
        self._bytes_by_op.clear()
        self._calls_by_op.clear()
