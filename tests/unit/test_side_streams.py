"""Side streams and offload landings (zeroshard/runtime/streams.py, [Note: side streams]).

On the CPU there are none, so its path is exactly what it was. On an accelerator the order of
records and waits is what makes the overlap correct; a recording runtime checks it here.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from zeroshard.comm import host_sync

try:
    from zeroshard.runtime import streams
except ImportError:  # the package in rooms
    from zeroshard.runtime import streams  # type: ignore[no-redef]


class Recording:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.events = 0

    def available(self, device):
        return device.type != "cpu"

    def new_stream(self, device):
        self.streams = getattr(self, "streams", 0) + 1
        return f"stream{self.streams}"

    def record(self, device, stream=None):
        self.events += 1
        self.calls.append(("record", self.events))
        return self.events

    def wait_event(self, stream, event):
        self.calls.append(("wait", stream, event))

    @contextlib.contextmanager
    def use(self, stream):
        self.calls.append(("enter", stream))
        yield
        self.calls.append(("exit", stream))

    def synchronize(self, event):
        self.calls.append(("host_wait", event))


@pytest.fixture
def recording(monkeypatch):
    rt = Recording()
    monkeypatch.setattr(streams, "RUNTIME", [rt])
    return rt


def test_the_cpu_has_no_side_streams_and_no_landings():
    assert streams.side_streams(torch.device("cpu")) is None
    assert streams.landing(torch.device("cpu")) is None


def test_gathers_wait_for_the_step_start_and_for_freed_buffers(recording):
    side = streams.side_streams(torch.device("cuda", 0))
    assert side is not None
    recording.calls.clear()
    side.begin_step()
    with side.gathering():
        pass
    side.freed()
    with side.gathering():
        pass
    assert recording.calls == [
        ("record", 1), ("wait", side.gather, 1),           # the optimizer's writes, once per step
        ("enter", side.gather), ("exit", side.gather),
        ("record", 2),                                      # a full buffer freed on the compute stream
        ("wait", side.gather, 2), ("enter", side.gather), ("exit", side.gather),
    ]


def test_each_reduction_waits_for_the_compute_that_made_its_grads(recording):
    side = streams.side_streams(torch.device("cuda", 0))
    recording.calls.clear()
    for _ in range(2):
        with side.reducing():
            pass
    assert recording.calls == [("record", 1), ("wait", side.reduce, 1), ("enter", side.reduce), ("exit", side.reduce),
                               ("record", 2), ("wait", side.reduce, 2), ("enter", side.reduce), ("exit", side.reduce)]


def test_one_host_wait_covers_every_copy_queued_before_it(recording):
    host_sync.reset()
    landings = streams.Landings(torch.device("cuda", 0))
    first, second = landings.copied(), landings.copied()
    landings.wait(first, "test.landed")
    landings.wait(second, "test.landed")  # covered by the same wait: the newest event
    third = landings.copied()
    landings.wait(third, "test.landed")
    assert [c for c in recording.calls if c[0] == "host_wait"] == [("host_wait", 2), ("host_wait", 3)]
    assert host_sync.counts() == {"test.landed": 2}
    host_sync.reset()
