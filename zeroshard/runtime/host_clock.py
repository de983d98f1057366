"""The engine's own host time, by kind of work, measured only when asked.

``with recording(): zs.shard(...)`` gives the engines built inside it a ``HostClock``
(``engine.host_clock``; None otherwise). The engine then registers timed versions of its hooks and
times its units' reductions, its groups' copies into the params and the sharded optimizer's step;
an engine built outside ``recording`` registers the plain callables, so the normal path pays
nothing, not even a flag test. Time is exclusive: a reduction finished from inside a grad hook is
charged to ``reduce``, not to ``post_backward`` as well, so the kinds add up to the engine's total.
The clock reads ``time.perf_counter_ns`` into a fixed table; it changes no number the step computes.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator

KINDS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "reduce", "optimizer", "param_copy",
         "optimizer_math")
"""What each kind covers: the forward pre-hooks (the root's step start, each unit's gather and
prefetch); the forward hooks (reshard, arming the pre-backward hook); the pre-backward hooks
(gather for backward); the grad hooks and the end-of-backward callback (ready counting, collecting
grads, launching in order); launching and finishing reductions (packing, waiting, averaging); the
sharded optimizer's step and zero_grad less the rest; shard -> full param copies with their
all-gather's issue (stage 3's gathers, stages 0-2's param sync after the step)."""

PRE_FORWARD, POST_FORWARD, PRE_BACKWARD, POST_BACKWARD, REDUCE, OPTIMIZER, PARAM_COPY, OPTIMIZER_MATH = range(len(KINDS))
RUNTIME_KINDS = KINDS[:OPTIMIZER_MATH]
"""The runtime's own work: what a plain PyTorch step does not do."""

_REQUESTED = [0]


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Engines built inside this block time their host work (``Engine.host_clock``)."""
    _REQUESTED[0] += 1
    try:
        yield
    finally:
        _REQUESTED[0] -= 1


def requested() -> HostClock | None:
    """A fresh clock when inside ``recording``, else None."""
    return HostClock() if _REQUESTED[0] else None


class HostClock:
    """Nanoseconds and calls per kind (``KINDS``) since the last ``reset``; nested kinds are exclusive."""

    def __init__(self) -> None:
        self.ns = [0] * len(KINDS)
        self.calls = [0] * len(KINDS)
        self._stack: list[int] = []
        self._since = 0

    def reset(self) -> None:
        self.ns[:] = [0] * len(KINDS)
        self.calls[:] = [0] * len(KINDS)

    def enter(self, kind: int) -> None:
        now = time.perf_counter_ns()
        if self._stack:
            self.ns[self._stack[-1]] += now - self._since
        self._stack.append(kind)
        self.calls[kind] += 1
        self._since = now

    def exit(self) -> None:
        now = time.perf_counter_ns()
        self.ns[self._stack.pop()] += now - self._since
        self._since = now

    def wrap(self, kind: int, fn: Callable) -> Callable:
        """``fn`` timed as ``kind``."""
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.enter(kind)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()
        return timed

    def instrument(self, obj: Any, method: str, kind: int) -> None:
        """Time ``obj.method`` as ``kind`` from now on (an attribute of that one instance)."""
        setattr(obj, method, self.wrap(kind, getattr(obj, method)))

    def table(self) -> dict[str, dict[str, int]]:
        """``{kind: {"ns": ..., "calls": ...}}`` accumulated since the last ``reset``."""
        return {k: {"ns": self.ns[i], "calls": self.calls[i]} for i, k in enumerate(KINDS)}


def timed_if(clock: HostClock | None, kind: int, fn: Callable) -> Callable:
    """``fn`` itself without a clock, else ``fn`` timed as ``kind``."""
    return fn if clock is None else clock.wrap(kind, fn)
