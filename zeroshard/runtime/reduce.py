"""The gradient reduction of one flat group: launched at the end of its unit's backward, finished later.

Two ways to reduce, chosen per launch by ``FlatGroup.launch_reduce``:

- a whole flat buffer (``WholeReduction``): an all-reduce (stage 0), a reduce-scatter (stages
  1-3) or the quantized reduce (qgZ), reading the group's flat grad buffer;
- pieces (``PieceReduction``): with gloo at stages 2-3, each grad is reduced where it lies, cut at
  shard boundaries, with small grads packed per owner; no unit-sized flat buffer exists then.

Either way at most one reduction per group is in flight, held as one of those two records, and
``finish`` turns it into this rank's averaged grad shard in the master dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import torch

from zeroshard.comm import collectives
from zeroshard.comm.mesh import Mesh
from zeroshard.comm.names import Group
from zeroshard.comm.quant import ErrorFeedback, QuantizedReduce
from zeroshard.runtime.layout import FlatLayout

SMALL_GRAD_NUMEL = 1 << 16
"""Grads smaller than this (elements) are packed per owner for gloo's in-place reduce, not sent alone."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """One tensor reduced to its owner shard rank, and where its values go in the owner's shard:
    ``spans`` are (offset in the tensor, offset in the owner's shard, length)."""

    tensor: torch.Tensor
    owner: int
    spans: list[tuple[int, int, int]]


@dataclasses.dataclass(frozen=True)
class WholeReduction:
    """A reduction of one flat tensor. ``source`` is what the collective reads (kept alive until it
    completes: gloo reads it asynchronously); ``output`` is where this rank's sums land, which may
    be ``source`` itself (all-reduce) or a view of it (gloo's reduce-scatter lands in its input)."""

    source: torch.Tensor
    output: torch.Tensor
    pending: collectives.Pending | QuantizedReduce


@dataclasses.dataclass(frozen=True)
class PieceReduction:
    """A reduction of grads where they lie; the pieces keep their storages alive until finished."""

    pieces: list[Piece]
    pending: collectives.Pending


InFlight = Union[WholeReduction, PieceReduction]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReduceTarget:
    """What a group's reduction needs to know of it: its layout, this rank's slice and the dtypes."""

    unit: str
    layout: FlatLayout
    shard_rank: int
    lo: int
    hi: int
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    device: torch.device


class GradReducer:
    """Reduces one flat group's grads across ranks and averages them, one reduction at a time.

    ``launch_whole`` / ``launch_quantized`` / ``launch_pieces`` issue the collective (async) and
    keep it as ``in_flight``; ``finish`` waits, adds the replica all-reduce when the mesh is
    hybrid, casts to the master dtype and divides by the data-parallel world, returning a tensor the caller owns.
    ``shard_optimizer`` says whether ranks keep a shard (reduce-scatter) or everything (all-reduce).
    """

    def __init__(self, target: ReduceTarget, *, mesh: Mesh, shard_optimizer: bool) -> None:
        self.target = target
        self.mesh = mesh
        self.shard_optimizer = shard_optimizer
        self.in_flight: InFlight | None = None

    @property
    def reducing(self) -> bool:
        return self.in_flight is not None

    def buffers_in_flight(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """(what the reduction in flight keeps alive only while it runs, where its sums land):
        the per-param pieces on gloo, else the flat source unless the sums land in it. Both
        empty/None when nothing is in flight."""
        flight = self.in_flight
        if isinstance(flight, PieceReduction):  # gloo reduces the grads in place, piece by piece
            return [piece.tensor for piece in flight.pieces], None
        if flight is None:
            return [], None
        return ([] if flight.source is flight.output else [flight.source]), flight.output

    @property
    def done(self) -> bool:
        """True unless a reduction is in flight and the backend has not completed it."""
        return self.in_flight is None or self.in_flight.pending.is_done()

    # -- launch --------------------------------------------------------------------------------
    def launch_quantized(self, grad_full: torch.Tensor, block_size: int, phase: str, *,
                         feedback: ErrorFeedback | None = None) -> None:
        """qgZ: int8 pieces through an all-to-all, summed in fp32 by their owner; ``feedback`` carries
        this rank's rounding error into its next reduction."""
        t = self.target
        reduced = torch.empty(t.layout.shard_numel, dtype=torch.float32, device=t.device)
        pending = QuantizedReduce(reduced, grad_full, block_size, group=Group.SHARD, unit=t.unit, phase=phase,
                                  feedback=feedback, mesh=self.mesh)
        self.in_flight = WholeReduction(grad_full, reduced, pending)

    def launch_whole(self, source: torch.Tensor, phase: str) -> None:
        """All-reduce (no sharded optimizer) or reduce-scatter ``source``, the flat grads in the reduce dtype."""
        t = self.target
        if not self.shard_optimizer:
            pending = collectives.all_reduce(source, group=self.mesh.dp_name, unit=t.unit, phase=phase,
                                             async_op=True, mesh=self.mesh)
            assert pending is not None  # async_op=True always returns a handle
            self.in_flight = WholeReduction(source, source, pending)
            return
        if collectives.reduce_scatter_lands_in_input(Group.SHARD, self.mesh):
            # No second shard-sized buffer while it runs; finish copies the slice out.
            reduced = source[t.lo:t.hi]
        else:
            reduced = torch.empty(t.layout.shard_numel, dtype=t.reduce_dtype, device=source.device)
        pending = collectives.reduce_scatter(reduced, source, group=Group.SHARD, unit=t.unit, phase=phase,
                                             async_op=True, mesh=self.mesh)
        assert pending is not None
        self.in_flight = WholeReduction(source, reduced, pending)

    def launch_pieces(self, pieces: list[Piece], phase: str) -> None:
        t = self.target
        pending = collectives.reduce_to_owners([(p.tensor, p.owner) for p in pieces], numel=t.layout.numel,
                                               group=Group.SHARD, unit=t.unit, phase=phase, async_op=True,
                                               mesh=self.mesh)
        assert pending is not None
        self.in_flight = PieceReduction(pieces, pending)

    def pieces(self, grads: list[torch.Tensor | None]) -> list[Piece] | None:
        """The grads (one per slot, None for a param without one) as reduce pieces; None when one
        is not in the reduce dtype or not contiguous. A large grad is cut at shard boundaries into
        views of itself; the small ones (biases, norms) are packed into one buffer per owner, since
        every gloo op has a fixed cost that would dominate tiny pieces."""
        t = self.target
        if any(g is not None and (g.dtype != t.reduce_dtype or not g.is_contiguous()) for g in grads):
            return None
        per_shard = t.layout.shard_numel
        large: list[Piece] = []
        small: dict[int, list[tuple[torch.Tensor, int, int, int]]] = {}  # owner -> (flat, start, shard offset, n)
        for slot, grad in zip(t.layout.slots, grads):
            # A param unused here may have grads on other ranks: every rank reduces the same pieces.
            flat = (torch.zeros(slot.numel, dtype=t.reduce_dtype, device=t.device) if grad is None
                    else grad.view(-1))
            start = slot.offset
            while start < slot.end:
                owner = start // per_shard
                stop = min(slot.end, (owner + 1) * per_shard)
                a, n, shard_offset = start - slot.offset, stop - start, start - owner * per_shard
                if slot.numel >= SMALL_GRAD_NUMEL:
                    large.append(Piece(flat[a:a + n], owner, [(0, shard_offset, n)]))
                else:
                    small.setdefault(owner, []).append((flat, a, shard_offset, n))
                start = stop
        packed = []
        for owner in sorted(small):
            parts = small[owner]
            buffer = torch.empty(sum(n for *_, n in parts), dtype=t.reduce_dtype, device=t.device)
            spans, at = [], 0
            for flat, a, shard_offset, n in parts:
                buffer[at:at + n].copy_(flat[a:a + n])
                spans.append((at, shard_offset, n))
                at += n
            packed.append(Piece(buffer, owner, spans))
        return large + packed

    # -- finish --------------------------------------------------------------------------------
    def finish(self, phase: str) -> torch.Tensor:
        """Wait for the reduction in flight; return this rank's averaged grad shard in the master
        dtype. With a sharded optimizer it is never a view of the flat grads (which it would keep
        alive); at stage 0 it is the flat grad buffer itself, reduced in place."""
        flight = self.in_flight
        assert flight is not None, "finish without a launch"
        flight.pending.wait()
        self.in_flight = None
        t = self.target
        if isinstance(flight, PieceReduction):  # gather this rank's sums (padding stays zero)
            reduced = torch.zeros(t.layout.shard_numel, dtype=t.reduce_dtype, device=t.device)
            for piece in flight.pieces:
                if piece.owner == t.shard_rank:
                    for at, offset, n in piece.spans:
                        reduced[offset:offset + n].copy_(piece.tensor[at:at + n])
        else:
            reduced = flight.output
        if self.shard_optimizer and self.mesh.replicate_size > 1:
            collectives.all_reduce(reduced, group=Group.REPLICATE, unit=t.unit, phase=phase, mesh=self.mesh)
        if reduced.dtype != t.master_dtype:
            reduced = reduced.to(t.master_dtype)
        elif self.shard_optimizer and isinstance(flight, WholeReduction) and \
                reduced.data_ptr() == flight.source[t.lo:].data_ptr():
            reduced = reduced.clone()  # a view would keep the whole full-grad buffer alive
        # Sum, then divide once by the data-parallel world (tp ranks hold different parts, not
        # replicas): the same arithmetic at every stage and mesh shape.
        if self.mesh.dp_size > 1:
            reduced.div_(self.mesh.dp_size)
        return reduced
