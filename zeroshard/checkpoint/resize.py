"""Shrink and grow: resuming on another number of data-parallel ranks with the same global batch.

A checkpoint loads at any world size; what a resize must settle is the batch. The global batch
(and so the loss, the gradient and the data order: the sampler's position is global) stays what it
was. Each rank's share of it changes, so accumulation is recomputed to keep the micro-batch a rank
runs at once no larger than before, which is what its memory was sized for: 4 ranks x accum 1 on
2 ranks becomes accum 2, 2 ranks x accum 2 on 4 ranks becomes accum 1. Under pipeline parallelism
a rank runs one pipeline microbatch at a time (each accumulation step's slice split into
``microbatches``), so that is the size kept, and the slice must split into the new run's
microbatches. A world that does not divide the global batch cannot keep it: that is an error
naming the worlds that can.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroshard.checkpoint.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Resize:
    """A resume on another data-parallel world, and the accumulation that keeps the global batch."""

    at_step: int
    batch: int
    from_world: int
    to_world: int
    from_accum: int
    to_accum: int
    from_microbatches: int = 1
    """Pipeline microbatches per accumulation step before (1 without pp)."""
    to_microbatches: int = 1

    @property
    def micro_batch(self) -> int:
        """Sequences one rank runs at once after the resize."""
        return self.batch // (self.to_world * self.to_accum * self.to_microbatches)

    def describe(self) -> str:
        before = self.batch // (self.from_world * self.from_accum * self.from_microbatches)
        return (f"resized from {self.from_world} to {self.to_world} data-parallel ranks at step {self.at_step}: "
                f"accumulation {self.from_accum} -> {self.to_accum} keeps the global batch of {self.batch} "
                f"(micro-batch {before} -> {self.micro_batch} sequences per rank)")

    def as_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), micro_batch=self.micro_batch)


def plan_resize(*, step: int, batch: int, saved_world: int, saved_accum: int, world: int,
                saved_microbatches: int = 1, microbatches: int = 1) -> Resize | None:
    """The resize of a resume at ``step`` from ``saved_world`` data-parallel ranks running
    ``saved_accum`` micro-steps to ``world`` ranks; None when the world is the same.
    ``microbatches``: the pipeline microbatches each micro-step is split into (1 without pp)."""
    if world == saved_world:
        return None
    if batch % world:
        fits = [w for w in range(1, 2 * max(world, saved_world) + 1) if batch % w == 0]
        raise CheckpointError(
            f"cannot resume on {world} data-parallel ranks: the global batch of {batch} sequences does not split "
            f"over them, so the run could not keep it; resume on one of {fits} ranks")
    per_rank = batch // world
    saved_micro = max(1, batch // (saved_world * saved_accum * saved_microbatches))
    # The fewest micro-steps whose micro-batch is no larger than before (a divisor of the rank's
    # share, whose slices the pipeline's microbatches split evenly).
    fits = [a for a in range(1, per_rank + 1)
            if per_rank % (a * microbatches) == 0 and per_rank // (a * microbatches) <= saved_micro]
    if not fits:
        raise CheckpointError(
            f"cannot resume on {world} data-parallel ranks with {microbatches} pipeline microbatches: each rank's "
            f"{per_rank} sequences of the global batch of {batch} do not split into micro-steps of {microbatches} "
            f"microbatches of at most {saved_micro} sequences; pass --microbatches dividing {per_rank}")
    return Resize(at_step=step, batch=batch, from_world=saved_world, to_world=world, from_accum=saved_accum,
                  to_accum=fits[0], from_microbatches=saved_microbatches, to_microbatches=microbatches)
