"""Wait times an accelerator can vouch for: device events around each device-async collective.

On NCCL a collective's ``wait()`` only makes the current (compute) stream wait for it and returns at
once, so the host's stopwatch reads ~0 for every wait, and the ledger's end time is whenever a poll
first saw the work done. The profiler's exposed time and overlap would be host queueing.

While a profiler runs on an accelerator it hangs a :class:`DeviceClock` on the ledger. For each
device-async collective the current stream then records three events: at the issue, just before the
wait and just after it. On that stream the time between the last two is exactly how long compute
stalled for the collective: its *exposed* time. The issue and after-wait events bound its life on
the device (an upper bound: a collective that finished long before anyone waited counts until the
wait). Once per profiled step, ``settle`` waits for the newest event (one host sync) and maps the
events onto the host clock through it, so the breakdown and the trace keep one timeline.

gloo (host-side waits) and a run without the profiler never create one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from zeroshard.comm.ledger import CollectiveRecord, Ledger

WAIT_CLOCKS = {"host": "host stopwatch around each wait (the collective ran on the host's threads)",
               "device": "device events on the compute stream: exposed = its stall at each wait, busy = issue to "
                         "wait (an upper bound)"}
"""What a profile's ``wait_clock`` says its wait and busy figures measured."""


class DeviceClock:
    """Events on ``device``'s current stream around each device-async collective; see the module."""

    def __init__(self, device: Any, new_event: Callable[[], Any] | None = None) -> None:
        self.device = device
        self._new_event = new_event or self._timing_event
        self._marks: dict[int, list] = {}
        """seq -> [record, issue event, before-wait event, after-wait event] (the last two once waited)."""

    @property
    def timing(self) -> list[int]:
        """The seqs of the collectives being timed (issued, not settled yet)."""
        return sorted(self._marks)

    def _timing_event(self) -> Any:
        import torch

        return torch.Event(device=self.device, enable_timing=True)

    def _mark(self) -> Any:
        event = self._new_event()
        event.record()
        return event

    def issued(self, record: CollectiveRecord) -> None:
        """Just before the collective is handed to the backend: the stream it will wait on is here."""
        self._marks[record.seq] = [record, self._mark(), None, None]

    def before_wait(self, record: CollectiveRecord) -> None:
        mark = self._marks.get(record.seq)
        if mark is not None:
            mark[2] = self._mark()

    def after_wait(self, record: CollectiveRecord) -> None:
        mark = self._marks.get(record.seq)
        if mark is not None and mark[2] is not None:
            mark[3] = self._mark()

    def settle(self, ledger: Ledger) -> int:
        """Wait for the stream to pass every wait recorded so far (one host sync) and give each
        waited-on collective its device-measured start, end and exposed time; it is complete then.
        Collectives not waited on yet stay for the next call. Returns how many were settled."""
        for seq in [seq for seq, m in self._marks.items() if m[3] is None and m[0].end is not None]:
            del self._marks[seq]  # closed without a wait (a poll saw it done): nothing to time, keep none
        done = [m for m in self._marks.values() if m[3] is not None]
        if not done:
            return 0
        last = self._mark()
        last.synchronize()
        now = time.perf_counter()

        def host(event: Any) -> float:  # the host time at which the stream passed ``event``
            return now - event.elapsed_time(last) / 1e3

        for record, issued, before, after in done:
            ledger.complete(record, observed=True)
            record.start, record.end = host(issued), host(after)
            record.waited = before.elapsed_time(after) / 1e3
            del self._marks[record.seq]
            if ledger.mirror is not None:
                ledger.mirror.update(record)
        return len(done)
