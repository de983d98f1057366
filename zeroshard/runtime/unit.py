"""A unit: the flat groups that are gathered, reshared and reduced together, with explicit state."""

from __future__ import annotations

import enum

from zeroshard.comm import collectives
from zeroshard.comm.quant import QuantizedGather
from zeroshard.runtime.events import EngineEvents, EventKind
from zeroshard.runtime.flat import FlatGroup


class UnitState(enum.Enum):
    SHARDED = "sharded"          # only this rank's shard exists (stage 3 between uses)
    GATHERING = "gathering"      # all-gather issued, not yet waited on
    UNSHARDED = "unsharded"      # full params registered on the modules


class FullTally:
    """Full-param bytes and units alive now, kept by the units of one engine as they gather and
    free: the engine samples it after every gather, which reading every unit's storages would make
    quadratic in the units per step. It equals the sum of the storages, which nothing but a unit's
    own ``unshard`` and ``reshard`` resizes (``Engine.live_full_bytes`` reads them for observers)."""

    __slots__ = ("bytes", "units")

    def __init__(self) -> None:
        self.bytes = 0
        self.units = 0


class Unit:
    """One module's (stage 3) or one bucket's (stages 0-2) flat groups, moved through one state machine.

    Params: ``unshard`` issues the groups' all-gathers, ``wait_unshard`` waits and registers the full
    params on the modules, ``reshard`` registers the 1-D shards back and frees the full buffers;
    ``state`` (a ``UnitState``) says which holds, and each call is a no-op in the wrong state, so the
    engine's hooks may call them freely. At stages 0-2 a unit is created unsharded and stays so.
    Grads: ``mark_ready`` counts the trainable params whose grad is complete; once all are, the
    engine launches the unit's reduction (``launch_reduce``), in its fixed order, and finishes it
    later (``finish_reduce``), leaving each group's averaged grad shard for the optimizer.
    Gathers and frees are reported to ``events``.
    """

    def __init__(self, name: str, module, groups: list[FlatGroup], *, is_root: bool, sharded: bool,
                 events: EngineEvents | None = None, tally: FullTally | None = None) -> None:
        self.name = name
        self.events = events or EngineEvents()
        self._phase = ""  # of the latest gather: a free reports the phase whose use of the params it ends
        self.module = module
        self.groups = groups
        self.trainable_groups: list[FlatGroup] = [g for g in groups if g.trainable]
        """Read per launch, finish and grad hook: an attribute, not a property (a call each time)."""
        self.is_root = is_root
        self.state = UnitState.SHARDED if sharded else UnitState.UNSHARDED
        self._gathers: list[collectives.Pending | QuantizedGather] = []
        self._expected = {(gi, pi) for gi, g in enumerate(groups) if g.trainable for pi in range(len(g.layout.slots))}
        self._ready: set[tuple[int, int]] = set()
        self._missing = len(self._expected)
        # Elements per trainable param and the running count of those ready: ready_fraction is read
        # once per grad of the unit that prefetches, so it must not sum over the unit each time.
        self._numel = {key: groups[key[0]].layout.slots[key[1]].numel for key in self._expected}
        self._total_numel = sum(self._numel.values())
        self._ready_numel = 0
        self.reduce_launched = False
        self.tally = tally or FullTally()
        self._live_bytes = 0  # what this unit added to the tally
        if sharded:
            for group in groups:
                group.free_full()
                group.register(unsharded=False)
        else:
            self._count_live()

    # -- params -------------------------------------------------------------------------------
    def unshard(self, phase: str) -> None:
        """Issue the all-gathers (async). Idempotent while gathering or unsharded."""
        if self.state is not UnitState.SHARDED:
            return
        self._gathers = []
        for group in self.groups:
            pending = group.gather_full(phase)
            if pending is not None:
                self._gathers.append(pending)
        self.state = UnitState.GATHERING
        self._count_live()
        self._phase = phase
        if self.events.active:
            self.events.emit(EventKind.GATHER, self.name, phase, self.full_bytes())

    def wait_unshard(self) -> None:
        if self.state is UnitState.UNSHARDED:
            return
        for pending in self._gathers:
            pending.wait()
        self._gathers = []
        for group in self.groups:
            group.register(unsharded=True)
        self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        if self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.GATHERING:
            self.wait_unshard()
        freed = self.full_bytes() if self.events.active else 0
        for group in self.groups:
            group.register(unsharded=False)
            group.free_full()
        self.state = UnitState.SHARDED
        self.tally.bytes -= self._live_bytes
        self.tally.units -= 1
        self._live_bytes = 0
        if self.events.active:
            self.events.emit(EventKind.FREE, self.name, self._phase, freed)

    def full_bytes(self) -> int:
        return sum(g.full_bytes() for g in self.groups)

    def _count_live(self) -> None:
        self._live_bytes = self.full_bytes()
        self.tally.bytes += self._live_bytes
        self.tally.units += 1

    # -- grads --------------------------------------------------------------------------------
    def mark_ready(self, group_index: int, param_index: int) -> bool:
        """Record that a param's grad is complete; True when every trainable param's is."""
        group = self.groups[group_index]
        if group.keeps_grads:  # stages 2-3 leave it on the param until the unit is ready: nothing to take
            group.take_grad(param_index)
        key = (group_index, param_index)
        if key not in self._ready:  # a param used twice fires its hook once per use
            self._ready.add(key)
            self._missing -= 1
            self._ready_numel += self._numel[key]
        # A count, not a set comparison: this runs once per param per backward.
        return self._missing == 0

    def collect_grads(self) -> None:
        for group in self.trainable_groups:
            group.collect_grads()

    @property
    def ready_fraction(self) -> float:
        """Share of this unit's trainable elements whose grads are complete in this backward."""
        return self._ready_numel / self._total_numel if self._total_numel else 1.0

    @property
    def grads_ready(self) -> bool:
        # A count, not a set comparison: this runs once per param per backward.
        return self._missing == 0

    def launch_reduce(self) -> None:
        for group in self.trainable_groups:
            group.launch_reduce()
        self.reduce_launched = True

    @property
    def reduce_done(self) -> bool:
        return all(g.reduce_done for g in self.trainable_groups)

    def finish_reduce(self) -> None:
        for group in self.trainable_groups:
            if group.reducing:
                group.finish_reduce()
        self.clear_ready()

    def clear_ready(self) -> None:
        self._ready.clear()
        self._missing = len(self._expected)
        self._ready_numel = 0
        self.reduce_launched = False
