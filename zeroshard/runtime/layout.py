"""Where each param lives inside a unit's flat buffer, and which slice each rank owns.

Every param starts at a multiple of ``ALIGN`` elements and the buffer length is a multiple of
``shards × ALIGN``. So every optimizer segment (a run of params inside one rank's shard) starts and
ends on an ALIGN boundary, whatever the world size. That is what makes stage 0 and stages 1–3
bitwise equal: CPU elementwise kernels take a vectorised path for full vectors and a scalar path
for the tail, and the two can round differently; with aligned segments no element is ever in a
tail. See docs/runtime.md.

Inside a buffer the params are laid out decaying ones first (``decay_first``), each class in model
order. The optimizer steps maximal runs of one param group (optim.py's segments), and its per-tensor
work runs once for each. In model order a block's matrices and its biases and norm weights
alternate (a twelve-param GPT block would be nine runs); grouped by the default weight-decay rule,
a rank's shard of a buffer holds two segments of small params, and its large ones one each.

A segment grows past the buffer's largest param only up to ``SEGMENT_NUMEL``: torch's per-tensor
optimizer loop (its default on the CPU, so every offloaded step) allocates temporaries the size of
the tensor it is on, so an unbounded run of a unit's matrices would multiply that peak.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, TypeVar

import torch

ALIGN = 64

SEGMENT_NUMEL = 1 << 20
"""Elements a merged optimizer segment may reach when no single param in the shard is larger: 4 MiB
of fp32, so three loop temporaries of it stay small beside any model worth sharding."""

T = TypeVar("T")


def decays(fqn: str, shape: torch.Size) -> bool:
    """Default weight-decay rule: matrices and embeddings decay; biases and norm weights do not."""
    return len(shape) >= 2


def decay_first(items: list[T], name_and_shape: Callable[[T], tuple[str, torch.Size]]) -> list[T]:
    """``items`` in buffer order: those ``decays`` picks first, then the rest, each in the given order.

    The engine's groups (runtime/grouping.py) and the planner's (tools/planner/inventory.py) both
    order their params with it, so the planner sees the runtime's segments."""
    flags = [decays(*name_and_shape(item)) for item in items]
    return [i for i, f in zip(items, flags) if f] + [i for i, f in zip(items, flags) if not f]


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

    def segments(self, shard_rank: int, key_of_slot: Callable[[int], T]) -> list[tuple[T, int, int]]:
        """(key, start, stop) of this rank's optimizer segments, in buffer order: consecutive pieces
        whose slots have one key (their param group) merged while the run stays within the larger of
        ``SEGMENT_NUMEL`` and the shard's largest piece. The sharded optimizer (runtime/optim.py)
        builds its params from these and the planner counts them, so both see the same runs."""
        pieces = self.pieces(shard_rank)
        cap = max([SEGMENT_NUMEL] + [p.numel for p in pieces])
        runs: list[list] = []
        for piece in pieces:
            key = key_of_slot(piece.slot_index)
            if runs and runs[-1][0] == key and runs[-1][2] == piece.start and piece.stop - runs[-1][1] <= cap:
                runs[-1][2] = piece.stop
            else:
                runs.append([key, piece.start, piece.stop])
        return [(key, start, stop) for key, start, stop in runs]

    def pieces(self, shard_rank: int) -> list[Piece]:
        """Intersections of each slot's span with this rank's shard, in buffer order."""
        lo, hi = self.shard_range(shard_rank)
        out = []
        for index, slot in enumerate(self.slots):
            start, stop = max(slot.offset, lo), min(slot.offset + slot.span, hi)
            if start < stop:
                out.append(Piece(slot_index=index, start=start, stop=stop))
        return out
