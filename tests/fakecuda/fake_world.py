"""A fake-GPU world in one process: accelerator tensors without a GPU, collectives without peers.

``FakeTensorMode`` makes tensors that carry a device, a shape and a dtype but no data: it raises on a
host/device mix in one op and on any data-dependent read (``.item()``, ``.tolist()``, ``bool`` of a
tensor). torch's fake process group (backend "fake", ``FakeStore``) accepts every collective and
moves nothing, so one process is rank 0 of a world of up to 8 (torchtitan's dry runs do the same).
What this world checks is devices, shapes, ledger bytes and host syncs, never numbers.

Why the device is ``fakecuda`` and not ``cuda``: on a CPU-only torch build a fake *CUDA* tensor
cannot go through autograd. The engine asks ``at::getAccelerator()`` for the current stream of every
accelerator input, and a build without CUDA has no CUDA accelerator ("Cannot access accelerator
device when none is available"); indexing and ``copy_`` fail earlier still (no CUDA device guard).
So the world registers torch's Python accelerator backend (PrivateUse1, renamed ``fakecuda``): it is
the process's accelerator as CUDA is on a GPU host, ``torch.accelerator`` and ``torch.Stream`` /
``torch.Event`` work on it, and the device guard below records every stream and event call so a test
can check their order. The runtime is device-agnostic, so it takes the path it takes on CUDA.

Registering a backend is for the life of the process: the world runs in a subprocess of its own
(tests/fakecuda/test_fake_world.py), never in a pytest worker that runs other tests.

With ``ZEROSHARD_REAL_CUDA=1`` on a machine with a GPU (bench/gpu.sh) the same checks run with real
CUDA tensors on that one device; the process group stays fake.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

REAL_CUDA = os.environ.get("ZEROSHARD_REAL_CUDA") == "1"
FAKE_DEVICE = "fakecuda"

CALLS: list[tuple] = []
"""Every stream/event call the fake device's guard saw, in order: ("record", event_id, stream_id),
("block", event_id, stream_id), ("set_stream", stream_id), ..."""


def _guard_class():
    class RecordingGuard(torch._C._acc.DeviceGuard):  # noqa: SLF001 (torch's Python backend hook)
        """The fake accelerator's device guard: one device, streams by id, events as counters."""

        def __init__(self) -> None:
            super().__init__()
            self.current = 0
            self.next_event = 1

        def type_(self):
            return torch._C._autograd.DeviceType.PrivateUse1  # noqa: SLF001

        def getDevice(self):
            return torch.device(FAKE_DEVICE, 0)

        def getStream(self, device):
            return torch.Stream(stream_id=self.current, device_index=0, device_type=_type_index())

        def exchangeStream(self, stream):
            prev = self.getStream(None)
            CALLS.append(("set_stream", stream.stream_id))
            self.current = stream.stream_id
            return prev

        def getNewStream(self, device, priority=0):
            CALLS.append(("new_stream",))
            return torch.Stream(stream_id=len([c for c in CALLS if c[0] == "new_stream"]), device_index=0,
                                device_type=_type_index())

        def record(self, event, stream, device_index, flag):
            CALLS.append(("record", stream.stream_id))

        def block(self, event, stream):
            CALLS.append(("block", stream.stream_id))

        def queryEvent(self, event):
            return True

        def synchronizeEvent(self, event):
            CALLS.append(("sync_event",))

        def synchronizeStream(self, stream):
            CALLS.append(("sync_stream", stream.stream_id))

        def deviceCount(self):
            return 1

    return RecordingGuard


def _type_index() -> int:
    return int(torch._C._autograd.DeviceType.PrivateUse1)  # noqa: SLF001


_REGISTERED: list[bool] = []


def register_fake_device() -> None:
    """Make ``fakecuda`` this process's accelerator (once; for the life of the process)."""
    if _REGISTERED:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    try:
        _setup_privateuseone_for_python_backend(rename=FAKE_DEVICE, device_guard=_guard_class()())
    except Exception:  # an older torch: its dummy guard (no recorded calls)
        _setup_privateuseone_for_python_backend(rename=FAKE_DEVICE)
    _REGISTERED.append(True)


def device() -> torch.device:
    return torch.device("cuda", 0) if REAL_CUDA else torch.device(FAKE_DEVICE, 0)


@contextlib.contextmanager
def fake_tensors():
    """Accelerator tensors for the ``with`` block: fake ones here, real ones where ZEROSHARD_REAL_CUDA=1."""
    if REAL_CUDA:
        yield None
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    register_fake_device()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def start_fake_world(world: int) -> None:
    """This process becomes rank 0 of a ``world``-rank fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
