"""Per-rank record of every collective this process issued.

Tests count bytes from it, the profiler reads durations from it and the doctor compares it across
ranks, so it is the one source of truth about communication. It is a bounded ring buffer: a long
run keeps the newest entries plus running totals that never roll off.

Each entry moves SCHEDULED (recorded, about to be handed to torch.distributed) → STARTED (the
backend accepted it) → COMPLETED (it finished: the backend's completion callback fired, or a wait
returned). An entry stuck in SCHEDULED or STARTED is what a hang looks like.

Threads: the training thread opens and waits on entries; the backend's completion callbacks and the
watchdog (zeroshard/observing/watchdog.py) touch them from other threads, so the set of open entries is
guarded by a lock. Field assignments on one record are single attribute stores (atomic under the GIL).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import os
import socket
import threading
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zeroshard.comm.device_clock import DeviceClock
    from zeroshard.observing.ring import RingMirror


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

    Times are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC on Linux, so comparable between the
    ranks of one machine). ``end`` is when it completed; ``wait_start`` when the training thread
    began to block on it and ``waited`` how long it blocked: the *exposed* part of its time.
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
    step: int = 0
    """Training step (1-based) it belongs to; 0 before the first step."""
    wait_start: float | None = None
    waited: float = 0.0
    observed: bool = False
    """True when ``end`` came from the backend's completion callback rather than from a wait: only
    then does ``end - start`` measure the collective itself (gloo runs some ops inside wait())."""
    mesh: str = ""
    """The mesh the group belongs to: empty for the default one (``zs.new_mesh`` names the others)."""
    uneven: bool = False
    """An all-to-all with per-rank splits (expert parallelism's token rows): each rank sends its own
    number of rows by design, so ``numel`` differs across ranks and is left out of the fingerprint."""

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["state"] = self.state.value
        return out

    @property
    def fingerprint(self) -> tuple[str, int, str, str, str, str]:
        """What must be identical on every rank for the same seq (see docs/diagnostics.md)."""
        group = f"{self.mesh}:{self.group}" if self.mesh else self.group  # two meshes' "shard" groups differ
        return (self.op, -1 if self.uneven else self.numel, self.dtype, group, self.unit, self.phase)


def fingerprint_key(op: str, numel: int, dtype: str, group: str, unit: str, phase: str) -> bytes:
    return f"{op}|{numel}|{dtype}|{group}|{unit}|{phase};".encode()


class Ledger:
    """Bounded ring buffer of :class:`CollectiveRecord` plus totals that survive eviction."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self.records: collections.deque[CollectiveRecord] = collections.deque(maxlen=capacity)
        self._next_seq = 0
        self._bytes_by_op: collections.Counter[str] = collections.Counter()
        self._calls_by_op: collections.Counter[str] = collections.Counter()
        self._open: dict[int, CollectiveRecord] = {}
        self._works: dict[int, Any] = {}  # device-async works still running, by seq
        self._lock = threading.Lock()
        self.step = 0
        """Set by the training loop; stamped on every new record."""
        self.hash = 0
        """Running CRC-32 of every record's fingerprint, in order; never rolls off (desync check)."""
        self.mirror: RingMirror | None = None  # set by the watchdog: a file copy of the ring
        """A crash-safe copy on disk (zeroshard.observing.ring.RingMirror), attached per run."""
        self.clock: DeviceClock | None = None
        """Set by the profiler on an accelerator: device events time the device-async collectives'
        waits (zeroshard/comm/device_clock.py)."""

    def open(self, *, group: str, op: str, numel: int, dtype, elem_size: int, unit: str, phase: str,
             mesh: str = "", uneven: bool = False) -> CollectiveRecord:
        record = CollectiveRecord(
            seq=self._next_seq,
            group=str(group),
            op=op,
            numel=numel,
            dtype=str(dtype).removeprefix("torch."),
            bytes=numel * elem_size,
            unit=unit,
            phase=str(phase),
            start=time.perf_counter(),
            step=self.step,
            mesh=mesh,
            uneven=uneven,
        )
        self._next_seq += 1
        self._bytes_by_op[op] += record.bytes
        self._calls_by_op[op] += 1
        self.hash = zlib.crc32(fingerprint_key(*record.fingerprint), self.hash)
        with self._lock:
            self.records.append(record)
            self._open[record.seq] = record
        if self.mirror is not None:
            self.mirror.write(record)
        return record

    def started(self, record: CollectiveRecord, work: Any = None, *, device_async: bool = False) -> None:
        """The backend accepted ``record``'s collective and returned ``work``.

        Completion is then taken from the best source the backend offers:

        - ``device_async`` (NCCL): ``wait()`` only orders CUDA streams and returns at once, so the record
          stays open until :meth:`poll` sees ``work.is_completed()``;
        - otherwise the work's future, when it has one (gloo's all-gather and all-reduce), calls back
          on completion: the true end time, even if nobody waits for a while;
        - otherwise (gloo's reduce-scatter, which runs inside ``wait()``) the wait's return closes it.
        """
        if record.state is CollectiveState.SCHEDULED:
            record.state = CollectiveState.STARTED
            if self.mirror is not None:
                self.mirror.update(record)
        if work is None:
            return
        if device_async:
            with self._lock:
                self._works[record.seq] = work
            if len(self._works) > 256:  # nobody polls (no watchdog, no profiler): stay bounded
                self.poll()
            return
        try:
            future = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented": closed when waited on
            return
        future.add_done_callback(lambda fut: self._on_done(fut, record))

    def _on_done(self, future: Any, record: CollectiveRecord) -> None:
        try:
            future.value()
        except Exception:  # noqa: BLE001 - a failed collective stays open: the dump shows it in flight
            return
        self.complete(record, observed=True)

    def wait_returned(self, record: CollectiveRecord) -> None:
        """A wait on ``record`` returned: it is complete, unless the device still runs it (NCCL).

        Then the record stays open (a device hang still shows), but the work, which holds the
        collective's tensors (an int8 wire buffer, an all-to-all's, a reduce-scatter's output), is
        swapped for an event behind it on the stream the wait ordered: the buffers are freed when
        their user drops them, not at the next poll (every 256 collectives without a watchdog)."""
        if record.seq not in self._works:
            self.complete(record)
            return
        marker = stream_marker()
        with self._lock:
            if record.seq in self._works:
                self._works[record.seq] = marker

    def poll(self) -> None:
        """Close device-async records whose work has finished (a no-op on gloo)."""
        if not self._works:
            return
        with self._lock:
            works = list(self._works.items())
        for seq, work in works:
            if work.is_completed():
                record = self._open.get(seq)
                with self._lock:
                    self._works.pop(seq, None)
                if record is not None:
                    self.complete(record, observed=True)

    def stuck(self, timeout_s: float, now: float | None = None) -> tuple[CollectiveRecord, float] | None:
        """The longest-blocked open record and for how long, if that exceeds ``timeout_s``.

        A host-side collective counts from when the training thread began to wait on it (a prefetch
        that nobody waits for yet blocks nothing); a device-async one from when it was issued.
        """
        now = time.perf_counter() if now is None else now
        worst: tuple[CollectiveRecord, float] | None = None
        with self._lock:
            candidates = [(r, r.seq in self._works) for r in self._open.values()]
        for record, on_device in candidates:
            since = record.start if on_device else record.wait_start
            if since is None:
                continue
            age = now - since
            if age > timeout_s and (worst is None or age > worst[1]):
                worst = (record, age)
        return worst

    def complete(self, record: CollectiveRecord, *, observed: bool = False) -> None:
        """Mark ``record`` finished; ``observed`` when called from the backend's completion callback."""
        with self._lock:
            if record.state is CollectiveState.COMPLETED:
                return
            record.end = time.perf_counter()
            record.observed = observed
            record.state = CollectiveState.COMPLETED
            self._open.pop(record.seq, None)
        if self.mirror is not None:
            self.mirror.update(record)

    def close(self, record: CollectiveRecord) -> None:
        """Backwards-compatible name for :meth:`complete`."""
        self.complete(record)

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
        with self._lock:
            if not self.records or self.records[-1].seq < seq:
                return []
            # Records are in seq order: walk back from the newest instead of over the whole ring.
            out = []
            for record in reversed(self.records):
                if record.seq < seq:
                    break
                out.append(record)
        out.reverse()
        return out

    def in_flight(self) -> list[CollectiveRecord]:
        with self._lock:
            return sorted(self._open.values(), key=lambda r: r.seq)

    def snapshot(self) -> list[CollectiveRecord]:
        with self._lock:
            return list(self.records)

    def reset(self) -> None:
        """Forget records and totals; sequence numbers keep counting so they stay unique."""
        with self._lock:
            self.records.clear()
            self._open.clear()
            self._works.clear()
        self._bytes_by_op.clear()
        self._calls_by_op.clear()

    # -- dumps --------------------------------------------------------------------------------
    def dump(self, path: str | Path, *, rank: int, world: int, reason: str, message: str = "",
             details: str = "", extra: dict[str, Any] | None = None) -> Path:
        """Write the buffer as JSON lines: one header object, then one object per record.

        Written to a temporary name and renamed, so a reader never sees half a dump.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        records = self.snapshot()
        header = {
            "kind": "header", "rank": rank, "world": world, "reason": reason, "message": message,
            "details": details, "time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
            "next_seq": self._next_seq, "capacity": self.capacity, "step": self.step,
            "first_seq": records[0].seq if records else self._next_seq, "hash": self.hash,
            "in_flight": [r.seq for r in records if r.state is not CollectiveState.COMPLETED],
            "on_device": sorted(self._works),  # still running on the device (NCCL), waited on or not
            "perf_counter": time.perf_counter(), **(extra or {}),
        }
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with tmp.open("w") as f:
            f.write(json.dumps(header) + "\n")
            for record in records:
                f.write(json.dumps({"kind": "collective", **record.to_json()}) + "\n")
        os.replace(tmp, path)
        return path


def read_dump(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, records) of a dump written by :meth:`Ledger.dump`."""
    header: dict = {}
    records: list[dict] = []
    with Path(path).open() as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            if obj.get("kind") == "header":
                header = obj
            else:
                records.append(obj)
    return header, records


class _StreamMarker:
    """An event recorded on the current stream: done once everything queued before it is. It has
    the one method of a work the ledger asks (``is_completed``) and holds no tensor."""

    __slots__ = ("_event",)

    def __init__(self, event: Any) -> None:
        self._event = event

    def is_completed(self) -> bool:
        return bool(self._event.query())


def stream_marker() -> _StreamMarker:
    """A marker on the accelerator's current stream, recorded now (only device-async backends ask)."""
    import torch  # here, not at the top: the doctor reads dumps without torch

    event = torch.Event()
    event.record()
    return _StreamMarker(event)


_PROCESS_LEDGER = Ledger()


def process_ledger() -> Ledger:
    """The ledger of this process: every mesh records into it unless it was given its own."""
    return _PROCESS_LEDGER
