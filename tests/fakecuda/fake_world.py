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
the process's accelerator as CUDA is on a GPU host, and ``torch.accelerator`` reports it. The
runtime is device-agnostic, so it takes the path it takes on CUDA; its stream and event calls go to
``RecordingStreams``, which records their order for the tests.

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


def module(*names: str):
    """The first of ``names`` that imports: a module's path before and after the package's move
    into rooms (zeroshard/sharding -> zeroshard/runtime, ...), so these tests read either layout."""
    import importlib

    for name in names[:-1]:
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    return importlib.import_module(names[-1])
FAKE_DEVICE = "fakecuda"

CALLS: list[tuple] = []
"""Every stream and event call the runtime made through ``RecordingStreams``, in order."""


class RecordingStreams:
    """zeroshard's stream runtime (zeroshard/runtime/streams.py) for the fake device: named streams
    and numbered events that do nothing but append what was asked to ``CALLS``. torch's Python
    accelerator backend runs no stream or event code of its own that a test could observe."""

    def __init__(self) -> None:
        self.streams = 0
        self.events = 0

    def available(self, dev: torch.device) -> bool:
        return dev.type != "cpu"

    def new_stream(self, dev: torch.device) -> str:
        self.streams += 1
        return f"side{self.streams}"

    def record(self, dev: torch.device, stream=None) -> int:
        self.events += 1
        CALLS.append(("record", self.events, stream or "compute"))
        return self.events

    def wait_event(self, stream, event) -> None:
        CALLS.append(("wait", event, stream))

    @contextlib.contextmanager
    def use(self, stream):
        CALLS.append(("enter", stream))
        try:
            yield
        finally:
            CALLS.append(("exit", stream))

    def synchronize(self, event) -> None:
        CALLS.append(("host_wait", event))


_REGISTERED: list[bool] = []


def _fake_pin_memory() -> None:
    """FakeTensorMode lists ``pin_memory`` as not implemented; offload pins its host store, so a
    pinned fake host tensor is a fake host tensor of the same shape (pinning changes no metadata)."""
    from torch._subclasses import fake_impls

    pin = torch.ops.aten._pin_memory.default  # noqa: SLF001 (torch's op name)
    fake_impls.op_implementations_dict[pin] = lambda fake_mode, func, t, device=None: t.clone()


def register_fake_device() -> None:
    """Make ``fakecuda`` this process's accelerator (once; for the life of the process), and put the
    recording stream runtime in zeroshard's place."""
    if _REGISTERED:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=FAKE_DEVICE)
    # The registration lasts the process (a pytest worker runs other files after this one): torch's
    # own helpers that ask whether the PrivateUse1 backend is available (DCP's file writer picks a
    # device-stream loader then) must keep seeing a plain CPU process.
    getattr(torch, FAKE_DEVICE).is_available = lambda: False
    _fake_pin_memory()
    streams = module("zeroshard.runtime.streams", "zeroshard.runtime.streams")
    streams.RUNTIME[:] = [RecordingStreams()]
    _REGISTERED.append(True)


def device() -> torch.device:
    if REAL_CUDA:
        return torch.device("cuda", 0)
    register_fake_device()
    return torch.device(FAKE_DEVICE, 0)


@contextlib.contextmanager
def fake_tensors():
    """Accelerator tensors for the ``with`` block: fake ones here, real ones where ZEROSHARD_REAL_CUDA=1."""
    if REAL_CUDA:
        yield None
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    register_fake_device()

    class Mode(FakeTensorMode):
        # What FakeTensorMode does by itself where no accelerator is registered: torch.tensor(data,
        # device=...) builds on the host and lifts the copy, and no op on constants runs for real
        # on the device. The fake device has no kernels, so both must stay fake here too.
        @property
        def avoid_device_init(self) -> bool:
            return True

    with Mode(allow_non_fake_inputs=True) as mode, _copy_watch():
        yield mode


COPIES: list[tuple[str, str, bool]] = []
"""Every copy between the host and the device the runtime made inside ``watch_copies``:
(from device type, to device type, non_blocking)."""


def _copy_watch():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CopyWatch(TorchDispatchMode):
        """A blocking device->host copy is a host sync that no ``.item()`` shows: FakeTensorMode lets
        ``.cpu()`` pass, so this records every host/device copy for the tests to count."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:  # noqa: SLF001
                src, dst = args[0].device.type, torch.device(kwargs["device"]).type
                if src != dst:
                    COPIES.append((src, dst, bool(kwargs.get("non_blocking", False))))
            elif func is torch.ops.aten.copy_.default:
                dst, src = args[0].device.type, args[1].device.type
                if src != dst:
                    COPIES.append((src, dst, bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking"))))
            return func(*args, **kwargs)

    return CopyWatch()


def start_fake_world(world: int) -> None:
    """This process becomes rank 0 of a ``world``-rank fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
