"""Where each param lives inside a unit's flat buffer, and which slice each rank owns.

Every param starts at a multiple of ``ALIGN`` elements and the buffer length is a multiple of
``shards × ALIGN``. So every optimizer segment (a run of params inside one rank's shard) starts and
ends on an ALIGN boundary, whatever the world size. That is what makes stage 0 and stages 1–3
bitwise equal: CPU elementwise kernels take a vectorised path for full vectors and a scalar path
for the tail, and the two can round differently; with aligned segments no element is ever in a
tail. See docs/runtime.md.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

ALIGN = 64


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclasses.dataclass(frozen=True)
class Slot:
    """One param's place in the flat buffer: elements [offset, offset + numel), padded to ``span``."""

    fqn: str
    shape: torch.Size
    numel: int
    offset: int
    span: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of a slot (including its padding) that falls in one rank's shard."""

    slot_index: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class FlatLayout:
    def __init__(self, names_and_shapes: list[tuple[str, torch.Size]], shards: int) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        slots, offset = [], 0
        for fqn, shape in names_and_shapes:
            numel = int(torch.Size(shape).numel())
            span = _round_up(max(numel, 1), ALIGN)
            slots.append(Slot(fqn=fqn, shape=torch.Size(shape), numel=numel, offset=offset, span=span))
            offset += span
        self.slots: list[Slot] = slots
        self.shards = shards
        self.numel = _round_up(max(offset, 1), shards * ALIGN)
        self.shard_numel = self.numel // shards

    @functools.cached_property
    def param_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def shard_range(self, shard_rank: int) -> tuple[int, int]:
        lo = shard_rank * self.shard_numel
        return lo, lo + self.shard_numel

    def pieces(self, shard_rank: int) -> list[Piece]:
        """Intersections of each slot's span with this rank's shard, in buffer order."""
        lo, hi = self.shard_range(shard_rank)
        out = []
        for index, slot in enumerate(self.slots):
            start, stop = max(slot.offset, lo), min(slot.offset + slot.span, hi)
            if start < stop:
                out.append(Piece(slot_index=index, start=start, stop=stop))
        return out
