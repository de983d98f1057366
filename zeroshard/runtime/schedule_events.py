"""The step schedule's vocabulary: the sizes it is derived from and the events it lists.

``UnitSizes`` (a communication unit's groups: names, padded and shard element counts, dtypes),
the layout's ``ParallelDims`` (zeroshard/comm/dims.py) and ``TensorParallelSizes`` are what
``step_schedule`` (zeroshard/runtime/schedule.py) reads instead of a live engine, so a tool can
build a schedule for a model that was never sharded.
``Event`` is one entry of the schedule: a collective as the ledger records it, a full-param free,
or a ``compute`` / ``wait`` mark; ``Schedule`` is the ordered list and its aggregates.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
FREE = "free"
"""The op of a buffer event: a unit's full params freed (resharded)."""
COMPUTE = "compute"
"""A mark, not a collective: where a unit's compute runs (``Event.share`` of its pass). Unit ``""``
is the model outside its units at stages 0-2: the whole forward, or the root's backward (the loss
and head, before any bucket's grads are in)."""
WAIT = "wait"
"""A mark: the step blocks here until every collective ``unit`` has in flight is done: its gather
(``Unit.wait_unshard``) or its reduction (``Unit.finish_reduce``)."""
MARKS = (COMPUTE, WAIT)

FORWARD, BACKWARD, RECOMPUTE, PARAM_SYNC, CLIP = "forward", "backward", "recompute", "param_sync", "clip"
OPTIMIZER = "optimizer"
"""The phase of the optimizer's compute marks, one per optimizer call (``optim._UnitPipeline``)."""
EXPERTS = "experts"
"""``Event.mesh`` of an expert group's collective (the dense mesh's is empty)."""


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the ledger writes it (``float32``, not ``torch.float32``)."""
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupSizes:
    """One flat group of a unit: what its collectives move."""

    numel: int
    """Padded elements of the flat buffer (``FlatLayout.numel``)."""
    shard_numel: int
    """Elements of one rank's shard (``FlatLayout.shard_numel``; ``numel`` when unsharded)."""
    trainable: bool = True
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    optimizer_numel: int | None = None
    """This rank's optimizer segment elements (its shard less the buffer tail); default the shard."""
    ep: int = 1
    """An expert group's ep degree (zeroshard/comm/expert_mesh.py): its collectives run on the expert
    mesh, sharded over the ``world / ep`` ranks that hold the same experts, with no replicas; 1 for a
    dense group."""

    @property
    def segment_numel(self) -> int:
        if not self.trainable:
            return 0
        return self.shard_numel if self.optimizer_numel is None else self.optimizer_numel


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitSizes:
    """A communication unit (a stage-3 module, or a stage 0-2 reduction bucket) and its groups."""

    name: str
    is_root: bool = False
    groups: tuple[GroupSizes, ...]
    blocks: int | None = None
    """Stages 0-2: how many of the model's blocks this bucket holds (its other params are the
    root's). Given for every bucket, each block's backward (and its tp all-reduces) is placed
    before the reduction it completes; otherwise the tp group's backward all-reduces come first."""

    @property
    def trainable(self) -> bool:
        return any(g.trainable for g in self.groups)

    @property
    def full_numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def full_bytes(self) -> int:
        return sum(g.numel * g.compute_dtype.itemsize for g in self.groups)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorParallelSizes:
    """What tensor parallelism (zeroshard/runtime/tp.py, Megatron's split through DTensor) all-reduces
    in each block: the attention's and the MLP's row-wise outputs in forward, and the grads of their
    column-wise inputs in backward, each a micro-batch's ``numel`` activations on the tp group. These
    come from DTensor, not from the engine, so the caller who knows the batch gives their size."""

    numel: int
    """Elements of one all-reduce: this rank's micro-batch tokens x the model width."""
    dtype: torch.dtype
    """The compute dtype the activations are all-reduced in."""
    blocks: int
    """The tp-split blocks, in module order; at stage 3 they are the units other than the root."""
    per_block: int = 2


@dataclasses.dataclass(frozen=True)
class ContextExchange:
    """One kind of a block's attention exchange over the cp group: ``count`` calls of ``op`` in
    ``phase``, each of ``numel`` elements as the ledger counts them."""

    op: str
    phase: str
    numel: int
    count: int


@dataclasses.dataclass(frozen=True)
class ContextParallelSizes:
    """What context parallelism's attention (zeroshard/parallel/cp/) exchanges over the cp group in
    every block, each micro-step: its forward's exchanges where the block runs forward, its
    recompute's and backward's where the block runs backward. They come from the attention, not
    from the engine, so the caller who knows the scheme and the batch gives their sizes
    (zeroshard/parallel/cp/volume.py ``schedule_sizes``). A checkpointed block's rebuild, which runs
    its forward's exchanges again, is not listed."""

    exchanges: tuple[ContextExchange, ...]
    dtype: torch.dtype
    blocks: int
    unit: str = "cp.attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """One thing the step does: a collective (what the ledger records for it) or a ``free``."""

    op: str
    group: str
    """world / shard / replicate / dp / tp; empty for a free."""
    unit: str
    phase: str
    """What it serves; a free has the phase of the gather whose params it frees (as ``EventKind.FREE``)."""
    numel: int
    """The full extent, as the ledger counts it: all-gather output, reduction input, unit's full params."""
    dtype: str
    bytes: int
    micro: int
    """The micro-step it serves: a reduction finished later (at the next forward, or in the
    optimizer step) keeps the micro-step that launched it; the optimizer step's own events
    carry the last one."""
    quantized: bool = False
    """Sent as int8 plus fp32 scales (``CommQuant``): this event is the payload or its scales."""
    share: float = 1.0
    """A compute mark: the share of the unit's pass (or, phase "optimizer", of the whole update)
    it stands for. Backward is split where the engine prefetches (``backward_prefetch_at``)."""
    mesh: str = ""
    """``experts`` for an expert group's collective (the ledger's expert mesh); empty on the dense mesh."""
    action: str = ""
    """A pipeline stage's step (``pipeline_order``): the kind of the microbatch's action it is issued
    in (F, B, or a split backward's I or W); empty otherwise."""

    @property
    def is_collective(self) -> bool:
        return self.op in COLLECTIVE_OPS

    @property
    def key(self) -> tuple[str, str, str, str, int, str]:
        """(op, group, unit, phase, numel, dtype): what a ledger record of it says."""
        return (self.op, self.group, self.unit, self.phase, self.numel, self.dtype)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The ordered events of one optimizer step."""

    events: tuple[Event, ...]

    @property
    def collectives(self) -> tuple[Event, ...]:
        return tuple(e for e in self.events if e.is_collective)

    @property
    def frees(self) -> tuple[Event, ...]:
        return tuple(e for e in self.events if e.op == FREE)

    @property
    def issued(self) -> tuple[Event, ...]:
        """The collectives and frees, without the marks: what the engine's ledger and events show."""
        return tuple(e for e in self.events if e.op not in MARKS)

    def peak_gathered_bytes(self, units: Sequence[UnitSizes]) -> int:
        """The most full-param bytes held gathered at once over the step (stage 3's all-gather
        window): a unit's full params count from its first all-gather until its free. The stage 1-2
        post-step all-gather writes into params that are always resident, so it holds nothing more."""
        return max(self._gathered_bytes(units), default=0)

    def gathered_at_backward_start(self, units: Sequence[UnitSizes]) -> int:
        """The most full-param bytes gathered when a micro-step's backward begins (its first
        compute after forward's): the units forward left gathered, before backward prefetches.
        Every activation forward saved is alive at that moment, so it is the window that moment holds."""
        held = self._gathered_bytes(units)
        starts, last = [0], None
        for i, e in enumerate(self.events):
            if e.op == COMPUTE:
                if last == FORWARD and e.phase != FORWARD:
                    starts.append(held[i])
                last = e.phase
        return max(starts)

    def _gathered_bytes(self, units: Sequence[UnitSizes]) -> list[int]:
        """Full-param bytes gathered after each event."""
        full = {u.name: u.full_bytes for u in units}
        held: set[str] = set()
        now, out = 0, []
        for e in self.events:
            if e.op == "all_gather" and e.phase != PARAM_SYNC and e.unit not in held and e.unit in full:
                held.add(e.unit)
                now += full[e.unit]
            elif e.op == FREE and e.unit in held:
                held.discard(e.unit)
                now -= full[e.unit]
            out.append(now)
        return out

    def bytes_by(self) -> dict[tuple[str, str], int]:
        """Collective bytes per (op, group) over the step."""
        out: dict[tuple[str, str], int] = {}
        for e in self.collectives:
            out[(e.op, e.group)] = out.get((e.op, e.group), 0) + e.bytes
        return out
