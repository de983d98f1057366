"""The step's reductions in their fixed order: launched as units' grads complete, finished in order.

Every rank launches the units' reductions strictly in ``order`` (the engine's units, backward
order), so a grad that is late on one rank (an unused param) delays the collectives instead of
reordering them; and finishes them (waits, frees the full grads, leaves the grad shard) in that same
order. ``launched`` and ``finished`` count how far each has gone this step; the units between them
are in flight.
"""

from __future__ import annotations

from zeroshard.runtime.unit import Unit


class ReductionQueue:
    """The engine's reductions of one step, launched and finished in ``order``."""

    def __init__(self, order: list[Unit]) -> None:
        self.order = order
        self.launched = 0
        self.finished = 0

    @property
    def in_flight(self) -> int:
        return self.launched - self.finished

    def launch_ready(self) -> None:
        """Launch, in order, every unit whose grads are all in (stopping at the first that is not)."""
        order = self.order
        while self.launched < len(order) and order[self.launched].grads_ready:
            order[self.launched].launch_reduce()
            self.launched += 1

    def launch_rest(self) -> None:
        """Launch every unit not launched yet, in order (grads still missing are reduced as zeros,
        so every rank issues the same collectives); a unit without trainable params has none."""
        for unit in self.order[self.launched:]:
            if unit.trainable_groups:
                unit.launch_reduce()
        self.launched = len(self.order)

    def launch_all(self) -> None:
        """Launch every unit's reduction, in order, from the first (a split backward's weight half)."""
        for unit in self.order:
            if unit.trainable_groups:
                unit.launch_reduce()
        self.launched = len(self.order)

    def reap(self, *, opportunistic: bool, cap: int | None) -> None:
        """Finish, in order, the reductions already done (when ``opportunistic``) and the oldest
        ones while more than ``cap`` are in flight (None: no cap)."""
        while self.finished < self.launched:
            unit = self.order[self.finished]
            over_cap = cap is not None and self.launched - self.finished > cap
            if not ((opportunistic and unit.reduce_done) or over_cap):
                break
            unit.finish_reduce()
            self.finished += 1

    def finish(self, through: Unit | None = None, *, restart: bool) -> None:
        """Finish the reductions in flight in order, up to and including ``through`` (default all);
        with ``restart`` (outside backward) and nothing left in flight, the next step starts again
        from the first unit."""
        while self.finished < self.launched:
            unit = self.order[self.finished]
            unit.finish_reduce()
            self.finished += 1
            if unit is through:
                break
        if restart and self.finished == self.launched:
            self.launched = self.finished = 0
