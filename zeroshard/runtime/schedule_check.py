"""Debug mode: check every optimizer step of an engine against its step schedule.

With ``EngineOptions(check_schedule=True)`` (``--check-schedule``, TOML ``check_schedule``) the
collectives the engine issued in a step, as its mesh's ledger recorded them, are compared op by op
with ``engine_schedule`` for that step when the optimizer step ends. The first difference raises
``ScheduleMismatchError`` naming the position and both sides. The schedule is what the planner
and the simulator read, so a step that differs from it would make their figures wrong without a
sign. The check costs one schedule derivation and one ledger scan per step: a debugging aid, off
by default.

A step runs from the first forward with grad enabled after the previous optimizer step to the end
of the next one; its micro-steps are its grad-enabled forwards. Only this engine's records count:
those on its mesh whose unit is one of its units, plus its mesh's clipping all-reduce. An eval
forward inside a step (stage 3 gathers for it too) is not part of any schedule, so the check does
not support one there.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.comm.names import Phase
from zeroshard.runtime.events import EventKind
from zeroshard.runtime.schedule import engine_schedule

if TYPE_CHECKING:
    from zeroshard.runtime.engine import Engine


class ScheduleMismatchError(RuntimeError):
    """The engine issued a step that differs from its schedule (a runtime bug: please report it)."""


class ScheduleCheck:
    """Watches one engine's steps and compares each with ``engine_schedule`` (see the module doc)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.units = {u.name for u in engine.units}
        self.start: int | None = None
        self.micro_steps = 0
        self.steps = 0
        # prepend: ahead of the engine's own pre-hook on the model, whose root gather opens the step.
        self.handles: list[Any] = [engine.model.register_forward_pre_hook(self._on_forward, prepend=True),
                        engine.events.subscribe(self._on_step, kinds=(EventKind.STEP,))]

    def _on_forward(self, module, args) -> None:
        if not torch.is_grad_enabled():
            return
        if self.start is None:
            self.start = self.engine.mesh.ledger.next_seq
        self.micro_steps += 1

    def _on_step(self, event) -> None:
        if self.start is None:  # an optimizer step with no forward before it: nothing to compare
            return
        mesh = self.engine.mesh
        # A per-tensor optimizer's owner exchange is the optimizer's, not the engine's: the schedule
        # does not hold it yet, and its bytes are checked against the layout (zeroshard/runtime/owners.py).
        records = [r for r in mesh.ledger.since(self.start) if r.mesh == mesh.ledger_name
                   and r.phase != Phase.OWNER_EXCHANGE
                   and (r.unit in self.units or (r.phase == Phase.CLIP and not r.unit))]
        clipped = any(r.phase == Phase.CLIP for r in records)
        schedule = engine_schedule(self.engine, accum=self.micro_steps, first_step=self.steps == 0, clip=clipped)
        want = [e.key for e in schedule.collectives]
        got = [(r.op, r.group, r.unit, r.phase, r.numel, r.dtype) for r in records]
        self.start, self.micro_steps, self.steps = None, 0, self.steps + 1
        for index, (a, b) in enumerate(itertools.zip_longest(want, got)):
            if a != b:
                raise ScheduleMismatchError(
                    f"step {self.steps}: collective {index} of {len(got)} differs from the step schedule "
                    f"({len(want)} scheduled): schedule {a}, ledger {b}. The planner and simulator model the "
                    "schedule, so this is a runtime bug; please report it with the config")

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
