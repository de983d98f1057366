"""Communication per optimizer step, and how long it takes on a given network.

The collectives of a model's layout are the runtime's own: ``step_collectives`` walks the
engine's step schedule (zeroshard/runtime/schedule.py, the list of events the ledger records,
op by op) over the units the inventory lays out, and sums its events into rows, one per (op,
group, phase, wire format) and size per micro-step. So stage 3 re-gathers in backward only what
the engine does (not the root, which stays gathered, nor the last block of forward, which it keeps
into backward), hybrid layouts add the replicate all-reduce of each reduced shard, quantized
communication (``CommQuant``) goes as int8 plus scales where the engine quantizes, and
accumulation reduces once or every micro-step as the stage and ``accumulation`` say. A bare
parameter count has no units: ``textbook_collectives`` gives the ZeRO paper's volumes (stage 0
all-reduces the grads; stages 1-2 reduce-scatter them and all-gather the params; stage 3
all-gathers in forward and again in backward, and reduce-scatters).

Per-rank wire bytes use the ring cost: (n-1)/n of the buffer for a reduce-scatter or all-gather,
twice that for an all-reduce. What the rows take in seconds is the simulator's model of the links
(``zeroshard.tools.sim.network.rows_seconds``): a group that spans nodes runs at the inter-node
bandwidth and latency.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from zeroshard.comm.quant import CommQuant
from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.options import EngineOptions
from zeroshard.runtime.schedule import step_schedule
from zeroshard.comm.dims import ParallelDims
from zeroshard.runtime.schedule_events import EXPERTS, ContextParallelSizes, Schedule, UnitSizes

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    op: str
    group: str
    """As the ledger names it: ``world`` (every rank; stage 0's all-reduce without tp), ``dp`` (the
    data-parallel ranks under tp), ``shard`` (the ranks a buffer is sharded over), ``replicate``
    (hybrid), ``tp`` (the ranks one layer is split over), ``ep`` (the ranks one MoE layer's experts
    are split over: the token all-to-alls) or ``edp`` (the ranks holding the same experts, which
    shard and reduce them)."""
    size: int
    """Ranks in the group."""
    buffer_bytes: int
    """Bytes of the full buffer (all-gather output, reduce-scatter input, all-reduce buffer)."""
    count: int = 1
    """Times per optimizer step."""
    spans_nodes: bool = False
    phase: str = ""
    """What it serves, as the ledger says: forward, backward, recompute, param_sync (empty for tp rows)."""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown collective {self.op!r}; use one of {', '.join(OPS)}")
        if self.size < 1 or self.buffer_bytes < 0 or self.count < 0:
            raise ValueError(f"collective {self.op} needs size >= 1 and non-negative bytes and count")

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends per step with a ring algorithm."""
        if self.size == 1:
            return 0
        factor = 2 if self.op == "all_reduce" else 1
        return int(factor * (self.size - 1) / self.size * self.buffer_bytes * self.count)


def step_collectives(units: Sequence[UnitSizes], *, policy: StagePolicy, mesh: ParallelDims, options: EngineOptions,
                     comm: CommQuant | None = None, accum: int = 1,
                     gpus_per_node: int | None = None, ep: int = 1,
                     pipeline_order: Sequence[tuple[str, int]] | None = None,
                     cp: ContextParallelSizes | None = None) -> tuple[Collective, ...]:
    """Collectives of one steady-state optimizer step of ``units`` (the engine's communication units,
    in its reduction order), from the runtime's step schedule. ``ep``: the expert groups' degree.
    ``pipeline_order``: a pipeline stage's microbatches in torch's order (``step_schedule``).
    ``cp``: the blocks' attention exchanges under context parallelism, which the schedule lists."""
    schedule = step_schedule(units, policy=policy, mesh=mesh, options=options, comm=comm, accum=accum,
                             pipeline_order=pipeline_order, cp=cp)
    return schedule_rows(schedule, mesh, gpus_per_node=gpus_per_node, ep=ep)


def context_rows(cp: ContextParallelSizes, *, mesh: ParallelDims, accum: int = 1,
                 gpus_per_node: int | None = None) -> tuple[Collective, ...]:
    """The cp rows of a step without the engine's units (textbook accounting): the runtime's
    schedule of the blocks alone, with their attention exchanges."""
    blocks = UnitSizes(name="blocks", groups=(), blocks=cp.blocks)
    schedule = step_schedule([blocks], policy=StagePolicy(0), mesh=mesh, options=EngineOptions(), accum=accum, cp=cp)
    return schedule_rows(Schedule(tuple(e for e in schedule.events if e.group == "cp")), mesh,
                         gpus_per_node=gpus_per_node)


def schedule_rows(schedule: Schedule, mesh: ParallelDims, *, gpus_per_node: int | None = None,
                  ep: int = 1) -> tuple[Collective, ...]:
    """The schedule's collectives summed into rows, in the order the step first issues them: per
    (op, group, phase, wire format), the bytes of each micro-step that moves any, one row per
    distinct figure with ``count`` the micro-steps that move it. An expert group's collectives
    (``Event.mesh``) run over its ``world / ep`` expert-data-parallel ranks (``dp / ep`` without
    tp): group ``edp``."""
    per_micro: dict[tuple[str, str, str, bool], dict[int, int]] = {}
    for e in schedule.collectives:
        group = EDP if e.mesh == EXPERTS else e.group
        moved = per_micro.setdefault((e.op, group, e.phase, e.quantized), {})
        moved[e.micro] = moved.get(e.micro, 0) + e.bytes
    out = []
    for (op, group, phase, _), moved in per_micro.items():
        counts: dict[int, int] = {}
        for nbytes in moved.values():
            counts[nbytes] = counts.get(nbytes, 0) + 1
        size = mesh.stage_world // ep if group == EDP else mesh.size(group)
        for nbytes, count in counts.items():
            out.append(Collective(op=op, group=group, size=size, buffer_bytes=nbytes, count=count,
                                  spans_nodes=_spans_nodes(group, mesh, gpus_per_node), phase=phase))
    return tuple(out)


EDP = "edp"
"""The planner's name for an expert group's ranks (the expert mesh's shard group, every ep-th rank)."""


def _spans_nodes(group: str, mesh: ParallelDims, gpus_per_node: int | None) -> bool:
    """Whether ``group`` crosses nodes of ``gpus_per_node`` data-parallel ranks (default: one node).
    An edp group (every ep-th rank) spans them exactly when the data-parallel ranks do."""
    if group == "cp":  # a cp group is tp-strided neighbours (dp_per_node is gpus_per_node / tp)
        return gpus_per_node is not None and mesh.cp > gpus_per_node
    gpn = gpus_per_node or mesh.dp
    return (mesh.zero_shard if group == "shard" else mesh.grad_dp) > gpn


def textbook_collectives(*, policy: StagePolicy, mesh: ParallelDims, padded: int, compute_bytes: int, reduce_bytes: int,
                         accum: int, accumulation: str, reshard_after_forward: bool,
                         gpus_per_node: int | None = None) -> tuple[Collective, ...]:
    """The ZeRO paper's volumes for a bare count of ``padded`` elements (no units, so every param
    is re-gathered in backward at stage 3 when resharded): what ``plan(7e9, ...)`` tabulates."""
    shards = mesh.zero_shard if policy.shard_optimizer else 1

    def row(op: str, group: str, nbytes: int, count: int, phase: str) -> Collective:
        return Collective(op=op, group=group, size=mesh.size(group), buffer_bytes=nbytes, count=count,
                          spans_nodes=_spans_nodes(group, mesh, gpus_per_node), phase=phase)

    # Stages 0-1 keep full grads, so no_sync defers their reduction to the last micro-step; stages
    # 2-3 reduce every micro-step unless accumulation is "unsharded".
    reductions = accum if policy.transient_grads and accumulation == "sharded" else 1
    grads = padded * reduce_bytes
    if not policy.shard_optimizer:
        return (row("all_reduce", mesh.dp_group, grads, reductions, "backward"),)
    out = [row("reduce_scatter", "shard", grads, reductions, "backward")]
    if mesh.replicate > 1:
        out.append(row("all_reduce", "replicate", grads // shards, reductions, "backward"))
    params = padded * compute_bytes
    if policy.gathers_after_step:
        out.append(row("all_gather", "shard", params, 1, "param_sync"))
        return tuple(out)
    out.append(row("all_gather", "shard", params, accum, "forward"))
    if reshard_after_forward:
        out.append(row("all_gather", "shard", params, accum, "backward"))
    return tuple(out)
