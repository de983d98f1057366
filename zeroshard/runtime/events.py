"""What the engine does, as events an observer can subscribe to without touching the runtime.

``engine.events.subscribe(callback)`` calls ``callback(event)`` synchronously, on the training
thread, at each of these moments (``EventKind``):

- ``gather``: a unit's all-gather was issued (stage 3; ``phase`` forward, backward or recompute).
  ``bytes``: the unit's full params in the compute dtype, padding included.
- ``free``: a unit's full params were freed; ``phase`` is that of the gather whose params it
  frees (the last block and the root, kept from forward into backward, report "forward"),
  ``bytes`` what was freed.
- ``grads_collected``: stages 2-3, a flat group's per-param grads were copied into its flat grad
  buffer and are about to be released; ``bytes`` is that buffer. At this moment both are alive,
  the memory peak a unit's reduction causes. (On gloo, fp32 grads are reduced where they lie,
  with no flat buffer, and this does not fire.)
- ``reduce_launched``: a flat group's reduction was issued; ``bytes`` is the grads it reduces, in
  the reduction dtype, padding excluded.
- ``reduce_done``: the engine finished that reduction (waited on it, averaged it, freed its
  buffers); ``bytes`` is the grad shard it left for the optimizer.
- ``step``: the sharded optimizer stepped; ``unit`` is empty, ``bytes`` this rank's master values.
- ``skip``: the non-finite guard skipped this optimizer step on every rank (zeroshard/runtime/guard.py);
  ``unit`` is the first unit found holding a non-finite grad ("" for a non-finite loss), ``bytes`` 0.
- ``compute_begin`` / ``compute_end``: under pp, the engine's pipeline stage started / finished one
  microbatch's compute (zeroshard/parallel/pipeline/stage.py); ``unit`` is the stage and microbatch
  (``stage1.mb3``, the ledger's unit for its sends and receives), ``phase`` "forward", "backward"
  (a whole backward, or a zero-bubble schedule's input half) or "backward_weight" (its weight half),
  ``bytes`` 0. Each begin is followed by its end before any other begin; what lies between two of
  them (waits on sends and receives, the schedule's own work) is the stage's idle time.

The order, which tests/distributed/test_events.py checks: a unit's gathers and frees alternate,
starting with a gather. Its grads_collected comes right before its reduce_launched (inside
``no_sync`` with unsharded accumulation it also fires alone, once per micro-step). Reductions
launch in ``engine.reduce_order`` (the same on every rank) and are done in that order, each after
its launch. One ``step`` per optimizer step follows the reduce_done of every unit whose grad shard
it reads (a unit whose shard on this rank is all padding is finished at ``zero_grad`` instead).
With ``EngineOptions(reap_when_done=False)`` the whole sequence is the same on every rank and run;
by default a reduction may be done sooner, as soon as the backend completes it.

A callback must not run collectives or change the model. With nobody subscribed an event costs
the engine one list check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Callable, Iterable, Iterator


class EventKind(enum.Enum):
    GATHER = "gather"
    FREE = "free"
    GRADS_COLLECTED = "grads_collected"
    REDUCE_LAUNCHED = "reduce_launched"
    REDUCE_DONE = "reduce_done"
    STEP = "step"
    SKIP = "skip"
    COMPUTE_BEGIN = "compute_begin"
    COMPUTE_END = "compute_end"


@dataclasses.dataclass(frozen=True)
class EngineEvent:
    """One thing the engine did: its kind, the unit it concerns, the phase of the step, and bytes
    (what the bytes count depends on the kind; see the module docstring)."""

    kind: EventKind
    unit: str
    phase: str
    bytes: int


Callback = Callable[[EngineEvent], None]


@dataclasses.dataclass(eq=False)
class Subscription:
    """A handle for one subscriber; ``remove()`` stops the calls (like a torch hook handle)."""

    bus: EngineEvents
    callback: Callback
    kinds: frozenset[EventKind] | None

    def remove(self) -> None:
        self.bus.unsubscribe(self)


class EngineEvents:
    """The subscribers of one engine, and the ``emit`` the runtime calls at each event."""

    def __init__(self) -> None:
        self._subscriptions: list[Subscription] = []
        self.active = False
        """Whether anyone listens: emitters may skip computing an event nobody receives (an
        attribute, not a property: the engine reads it several times per unit and step)."""

    def subscribe(self, callback: Callback, kinds: Iterable[EventKind] | None = None) -> Subscription:
        """Call ``callback(event)`` at every event of ``kinds`` (default: all), until removed."""
        sub = Subscription(self, callback, None if kinds is None else frozenset(kinds))
        self._subscriptions.append(sub)
        self.active = True
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subscriptions:
            self._subscriptions.remove(sub)
        self.active = bool(self._subscriptions)

    @contextlib.contextmanager
    def subscribed(self, callback: Callback, kinds: Iterable[EventKind] | None = None) -> Iterator[Subscription]:
        """``subscribe`` for the duration of a ``with`` block."""
        sub = self.subscribe(callback, kinds)
        try:
            yield sub
        finally:
            sub.remove()

    def emit(self, kind: EventKind, unit: str, phase: str, nbytes: int) -> None:
        if not self._subscriptions:
            return
        event = EngineEvent(kind, unit, phase, nbytes)
        for sub in list(self._subscriptions):  # a callback may unsubscribe itself
            if sub.kinds is None or kind in sub.kinds:
                sub.callback(event)
