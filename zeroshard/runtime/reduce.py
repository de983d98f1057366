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
from torch._utils import _flatten_dense_tensors

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


@dataclasses.dataclass(frozen=True)
class PiecePlan:
    """How a group's grads are cut into pieces, worked out once from its layout (it depends on no
    grad): ``large`` (slot, start in it, length, owner, shard offset) are sent as views of their
    grad; ``small`` per owner (in order) the (slot, start, length) packed into one buffer, with the
    spans ``Piece`` reports; ``mine`` rebuilds this rank's shard from the pieces in shard order:
    ("piece", index into the launch's pieces, start, length) or ("zero", 0, 0, length)."""

    large: list[tuple[int, int, int, int, int]]
    small: list[tuple[int, list[tuple[int, int, int]], list[tuple[int, int, int]]]]
    mine: list[tuple[str, int, int, int]]
    whole: list[list[int] | None]
    """Per ``small`` owner: its slots when every part is a whole slot (packed by one flatten), else None."""


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
        self._plan: PiecePlan | None = None

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
        dtype = t.reduce_dtype
        for g in grads:
            if g is not None and (g.dtype != dtype or not g.is_contiguous()):
                return None
        plan = self._plan or self._make_plan()
        slots = t.layout.slots
        # A param unused here may have grads on other ranks: every rank reduces the same pieces.
        present: list[torch.Tensor] = [torch.zeros(slot.shape, dtype=dtype, device=t.device) if grad is None
                                       else grad for slot, grad in zip(slots, grads)]
        out = [Piece(present[i].view(-1)[a:a + n], owner, [(0, offset, n)]) for i, a, n, owner, offset in plan.large]
        for (owner, parts, spans), whole in zip(plan.small, plan.whole):
            # One copy of every part into a fresh buffer: whole slots flattened in one call.
            buffer = _flatten_dense_tensors([present[i] for i in whole]) if whole is not None else \
                torch.cat([present[i].view(-1)[a:a + n] for i, a, n in parts])
            out.append(Piece(buffer, owner, spans))
        return out

    def _make_plan(self) -> PiecePlan:
        t = self.target
        per_shard = t.layout.shard_numel
        large: list[tuple[int, int, int, int, int]] = []
        small: dict[int, tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]] = {}
        for index, slot in enumerate(t.layout.slots):
            start = slot.offset
            while start < slot.end:
                owner = start // per_shard
                stop = min(slot.end, (owner + 1) * per_shard)
                a, n, shard_offset = start - slot.offset, stop - start, start - owner * per_shard
                if slot.numel >= SMALL_GRAD_NUMEL:
                    large.append((index, a, n, owner, shard_offset))
                else:
                    parts, spans = small.setdefault(owner, ([], []))
                    spans.append((sum(p[2] for p in parts), shard_offset, n))
                    parts.append((index, a, n))
                start = stop
        packed = [(owner, *small[owner]) for owner in sorted(small)]
        # This rank's shard in order: (shard offset, piece index, start in the piece, length) ...
        runs = [(offset, k, 0, n) for k, (_, _, n, owner, offset) in enumerate(large) if owner == t.shard_rank]
        for k, (owner, _, spans) in enumerate(packed):
            if owner == t.shard_rank:
                runs += [(offset, len(large) + k, at, n) for at, offset, n in spans]
        mine: list[tuple[str, int, int, int]] = []
        covered = 0
        for offset, k, at, n in sorted(runs):
            if offset > covered:
                mine.append(("zero", 0, 0, offset - covered))  # padding stays zero
            last = mine[-1] if mine else None
            if last is not None and last[0] == "piece" and last[1] == k and last[2] + last[3] == at:
                mine[-1] = ("piece", k, last[2], last[3] + n)  # contiguous in the piece too: one run
            else:
                mine.append(("piece", k, at, n))
            covered = offset + n
        if covered < per_shard:
            mine.append(("zero", 0, 0, per_shard - covered))
        whole = [[i for i, _, _ in parts] if all(n == t.layout.slots[i].numel for i, _, n in parts) else None
                 for _, parts, _ in packed]
        self._plan = PiecePlan(large=large, small=packed, mine=mine, whole=whole)
        return self._plan

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
            reduced = self.own_sums(flight.pieces)
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

    def own_sums(self, pieces: list[Piece]) -> torch.Tensor:
        """This rank's shard from the reduced pieces, in one concatenation (the plan's runs); a packed
        buffer that is the whole shard already is returned as it is (it is this reduction's own). A
        large piece never is: it is a view of a param's grad, whose whole storage it would keep alive."""
        t = self.target
        plan = self._plan or self._make_plan()
        mine = plan.mine
        if len(mine) == 1 and mine[0][0] == "piece" and mine[0][2] == 0 and mine[0][1] >= len(plan.large):
            whole = pieces[mine[0][1]].tensor
            if whole.numel() == t.layout.shard_numel and whole.dtype == t.reduce_dtype:
                return whole
        if not mine:
            return torch.zeros(t.layout.shard_numel, dtype=t.reduce_dtype, device=t.device)
        return torch.cat([torch.zeros(n, dtype=t.reduce_dtype, device=t.device) if kind == "zero"
                          else pieces[k].tensor[at:at + n] for kind, k, at, n in mine])
