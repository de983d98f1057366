"""Phase spans of the training thread: the one hook point the step profiler needs in the loop.

``with timeline.phase("forward"): ...`` costs one attribute read and a shared no-op context when no
profiler is active, and two ``perf_counter`` calls plus a list append when one is. Collective waits
are not recorded here: the ledger already stamps them (``wait_start``/``waited``), and the profiler
attributes each wait to the span it fell in.

Memory is sampled at span boundaries and when the runtime gathers or frees a unit (the step profiler
subscribes to the engine's gather and free events): the CUDA allocator's counter, or this process's
RSS read from /proc with one ``pread``, plus the engine's full-parameter bytes. That is the "memory
over a step" chart.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable

_NULL = contextlib.nullcontext()


def _rss_reader() -> Callable[[], int]:
    """Resident set size in bytes; 0 where /proc is not available."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return lambda: 0
    page = os.sysconf("SC_PAGE_SIZE")

    def read() -> int:
        return int(os.pread(fd, 128, 0).split()[1]) * page

    return read


def memory_reader(device) -> tuple[Callable[[], int], str]:
    """A cheap "current bytes" probe for ``device`` and the name of what it measures."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return (lambda: torch.cuda.memory_allocated(device)), "cuda allocated"
    return _rss_reader(), "rss"


class Timeline:
    """Spans (name, start, end) of one rank's training thread, and memory samples
    (time, bytes, full-param bytes, label) taken at span boundaries and unit gathers/frees."""

    def __init__(self, memory: Callable[[], int] | None = None, full_bytes: Callable[[], int] | None = None) -> None:
        self.spans: list[tuple[str, float, float]] = []
        self.samples: list[tuple[float, int, int, str]] = []
        self.memory = memory or (lambda: 0)
        self.full_bytes = full_bytes or (lambda: 0)

    def phase(self, name: str) -> _Span:
        return _Span(self, name)

    def sample(self, label: str) -> None:
        self.samples.append((time.perf_counter(), self.memory(), self.full_bytes(), label))

    def take(self) -> tuple[list[tuple[str, float, float]], list[tuple[float, int, int, str]]]:
        """The spans and samples recorded so far, and forget them."""
        spans, samples = self.spans, self.samples
        self.spans, self.samples = [], []
        return spans, samples


class _Span:
    __slots__ = ("timeline", "name", "t0")

    def __init__(self, timeline: Timeline, name: str) -> None:
        self.timeline = timeline
        self.name = name

    def __enter__(self) -> None:
        self.timeline.sample(self.name + " start")
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.timeline.spans.append((self.name, self.t0, time.perf_counter()))
        self.timeline.sample(self.name + " end")


_CURRENT: Timeline | None = None


def current() -> Timeline | None:
    return _CURRENT


def activate(timeline: Timeline | None) -> None:
    """Make ``timeline`` the one ``phase()`` records into (None: record nothing)."""
    global _CURRENT
    _CURRENT = timeline


def phase(name: str):
    """A context manager timing one phase of the step (a no-op without an active timeline)."""
    timeline = _CURRENT
    return _NULL if timeline is None else _Span(timeline, name)

