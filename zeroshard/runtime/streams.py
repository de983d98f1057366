"""Side streams and events on an accelerator, written against ``torch.accelerator``, ``torch.Stream``
and ``torch.Event`` so no device is named; on the CPU there are none and nothing here runs.

[Note: side streams]
On CUDA every kernel runs in the order it was queued on its stream, and a collective issued from a
stream waits for everything queued on that stream before it. Issued from the compute stream, each
all-gather's copy-in (shard -> full buffer, cast to the compute dtype) and each reduce-scatter's
packing (full grads -> reduce dtype) would wait for all the compute queued ahead of them, so a
prefetch would start only when the compute it should overlap is done. FSDP2's shape fixes that:

- the all-gather stream waits on the compute stream once per step (``begin_step``, at the root
  forward: the optimizer's writes to the shards are visible), then each unit's full buffer is
  allocated, filled and gathered on it. The compute stream waits for the gather in ``Pending.wait``
  (NCCL's ``work.wait()`` is a stream wait). A freed full buffer returns to the all-gather stream's
  pool at once, while compute kernels that read it may still be queued: ``freed`` records an event
  on the compute stream, and the next allocation on the all-gather stream waits for it first.
- the reduce stream waits on the compute stream at each launch (the grads it packs come from the
  compute just queued), then packs and issues the reduction there. The pack's inputs and outputs
  are kept alive by the reduction record until ``finish``, where the compute stream has waited.

An offloaded grad shard's device->host copy is non-blocking; ``Landings`` records an event right
after it, and every read of the host copy waits for that event first (``FlatGroup.grad_shard``).

``RUNTIME`` is the one place the torch calls are made; the fake-GPU tests put a recording one in its
place to check the order of records and waits.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from zeroshard.comm import host_sync


class TorchStreams:
    """Streams and events of the process's accelerator (``torch.accelerator``)."""

    def available(self, device: torch.device) -> bool:
        if device.type == "cpu" or not torch.accelerator.is_available():
            return False
        current = torch.accelerator.current_accelerator()
        return current is not None and current.type == device.type

    def new_stream(self, device: torch.device) -> Any:
        return torch.Stream(device=device)

    def record(self, device: torch.device, stream: Any = None) -> Any:
        """An event recorded on ``stream`` (the current stream of ``device`` when None)."""
        event = torch.Event(device=device)
        event.record(stream if stream is not None else torch.accelerator.current_stream(device))
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return stream

    def synchronize(self, event: Any) -> None:
        event.synchronize()


RUNTIME: list[Any] = [TorchStreams()]
"""The stream runtime in use (a list so a test can swap it for a recording one)."""


class SideStreams:
    """One engine's all-gather and reduce streams on an accelerator (see [Note: side streams])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        rt = RUNTIME[0]
        self.gather = rt.new_stream(device)
        self.reduce = rt.new_stream(device)
        self._freed: Any = None

    def begin_step(self) -> None:
        """The all-gather stream waits for everything queued so far (the optimizer's shard writes)."""
        rt = RUNTIME[0]
        rt.wait_event(self.gather, rt.record(self.device))
        self._freed = None

    @contextlib.contextmanager
    def gathering(self) -> Iterator[None]:
        """Allocate, copy in and issue an all-gather on the all-gather stream."""
        rt = RUNTIME[0]
        if self._freed is not None:  # a freed full buffer's memory may be reused below
            rt.wait_event(self.gather, self._freed)
            self._freed = None
        with rt.use(self.gather):
            yield

    def freed(self) -> None:
        """A full buffer was freed on the compute stream: later gathers wait until its readers ran."""
        self._freed = RUNTIME[0].record(self.device)

    @contextlib.contextmanager
    def reducing(self) -> Iterator[None]:
        """Pack and issue a reduction on the reduce stream, after the compute that made the grads."""
        rt = RUNTIME[0]
        rt.wait_event(self.reduce, rt.record(self.device))
        with rt.use(self.reduce):
            yield


def side_streams(device: torch.device) -> SideStreams | None:
    """The side streams for ``device``, or None on the CPU (its path stays as it was)."""
    return SideStreams(device) if RUNTIME[0].available(device) else None


class Landings:
    """One engine's device->host grad copies (offload). They are queued in order on the compute
    stream, so the event after the newest one covers all before it: a read waits for that one
    event only if its own copy is not yet covered, which makes one host sync per step, not per group."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._latest: Any = None
        self._queued = 0
        self._waited = 0

    def copied(self) -> int:
        """Call right after queuing a copy; returns its ticket for ``wait``."""
        self._latest = landing(self.device)
        self._queued += 1
        return self._queued

    def wait(self, ticket: int, where: str) -> None:
        """Block the host until the copy of ``ticket`` landed."""
        if ticket > self._waited:
            wait_landed(self._latest, self.device, where)
            self._waited = self._queued


def landing(device: torch.device) -> Any:
    """After a non-blocking copy to the host: an event on ``device``'s current stream that says it
    landed; None where no accelerator runtime can record one (the caller then syncs the device)."""
    rt = RUNTIME[0]
    return rt.record(device) if rt.available(device) else None


def wait_landed(event: Any, device: torch.device, where: str) -> None:
    """Block the host until a copy ``landing`` marked has landed (a counted host sync at ``where``)."""
    if event is None:
        host_sync.note(where)
        getattr(torch, device.type).synchronize()
        return
    host_sync.note(where)
    RUNTIME[0].synchronize(event)
