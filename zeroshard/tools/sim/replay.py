"""The runtime's step schedule, priced on the replay's two timelines: what ``simulate`` walks.

The simulator does not restate the engine's order. ``schedule_units`` builds the units the engine
would build for the workload's uniform blocks (each block's tp-local params and the root; at
stages 0-2 merged into the engine's buckets), ``step_schedule`` (zeroshard/runtime/schedule.py,
held to the ledger op by op) orders the step's gathers, reductions, frees and marks, and ``walk``
only prices each event:

- an all-gather launches on the shard group's stream, after the copy back of the unit's own slice
  when offloaded (it holds compute);
- a reduction launches on its group's stream;
- a wait mark blocks compute until the unit's collectives in flight are done; with offload, a
  finished reduction's shard then goes out over the host link;
- a compute mark runs its share of the unit's pass (measured or modelled, ``_Durations``);
- a tp all-reduce blocks compute (the next op needs the sum). It is priced, not launched: DTensor
  issues it on its own group, and nothing overlaps it;
- the optimizer step is priced after the step's last reduction, as one update at the measured or
  modelled rate, then (stages 1-2) one blocking all-gather of every updated param. The engine's
  unit pipeline, which steps the first units while later ones still reduce and gathers each unit
  after its own call, is not modelled: the replay's update is a bound on it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from zeroshard.parallel.cp.volume import schedule_sizes
from zeroshard.parallel.experts.tp_tokens import run_of
from zeroshard.tools.planner.tp import ALL_REDUCES_PER_LAYER, MOE_ALL_REDUCES_PER_LAYER
from zeroshard.runtime.engine import merge_in_order
from zeroshard.runtime.options import EngineOptions
from zeroshard.runtime.schedule import step_schedule
from zeroshard.runtime.schedule_events import (BACKWARD, COMPUTE, EXPERTS, FORWARD, FREE, OPTIMIZER, PARAM_SYNC,
                                                RECOMPUTE, WAIT, GroupSizes, Schedule, TensorParallelSizes,
                                                UnitSizes)
from zeroshard.tools.sim.network import collective_seconds, wire_bytes
from zeroshard.tools.sim.workload import TORCHTITAN_POLICIES, Workload

if TYPE_CHECKING:
    from zeroshard.tools.sim.step import Collective, CommLink, HostLink, Layout, _Durations

ROOT = "<root>"
DTYPES = {2: torch.bfloat16, 4: torch.float32}
"""The dtypes of the replay's byte widths (``Layout.param_bytes``, ``reduce_bytes``, ``Workload.compute_bytes``)."""


def _dtype(nbytes: int, what: str) -> torch.dtype:
    if nbytes not in DTYPES:
        raise ValueError(f"{what}={nbytes} bytes has no dtype here; use 2 (bf16) or 4 (fp32)")
    return DTYPES[nbytes]


@dataclasses.dataclass(frozen=True)
class ScheduleUnits:
    """The engine's units for a workload, and the blocks whose backward completes each one's grads."""

    units: tuple[UnitSizes, ...]
    blocks: dict[str, int]


def schedule_units(w: Workload, layout: Layout) -> ScheduleUnits:
    """The units the engine builds for ``w``'s blocks on ``layout``, in its reduction order: the
    blocks in reverse module order, then the root; at stages 0-2 merged into buckets, filled by
    fp32 param bytes as the engine fills them. Each flat buffer is padded to whole shards. Under
    ep a block's experts are a flat group of their own (this rank's ep block, sharded over the
    ranks that hold it), as ``zs.shard`` groups them."""
    shards, s = layout.shard_group, w.shape
    expert_shards = layout.expert_group if layout.policy.shard_optimizer else 1
    compute, reduce = _dtype(layout.param_bytes, "param_bytes"), _dtype(layout.reduce_bytes, "reduce_bytes")

    def group(numel: int, over: int, ep: int = 1) -> GroupSizes:
        padded = -(-numel // over) * over
        return GroupSizes(numel=padded, shard_numel=padded // over, compute_dtype=compute, reduce_dtype=reduce, ep=ep)

    def unit(name: str, numel: int, root: bool = False, experts: int = 0) -> UnitSizes:
        groups = (group(numel, shards),) + ((group(experts, expert_shards, layout.ep),) if experts else ())
        return UnitSizes(name=name, is_root=root, groups=groups)

    split = layout.ep > 1 and s.n_expert > 0
    expert_numel = s.expert_params // layout.ep if split else 0
    dense = s.block_params - (s.expert_params if split else 0)
    if s.n_expert and layout.tp > 1:  # the attention alone is tp split; the MoE layer stays whole
        attention = sum(s.block_matmuls[:4])
        block_numel = -(-attention // layout.tp) + dense - attention
    else:
        block_numel = -(-dense // layout.tp)  # its tp part, wholly split
    blocks = [unit(f"blocks.{i}", block_numel, experts=expert_numel) for i in reversed(range(s.n_layer))]
    units = blocks + [unit(ROOT, s.root_params, root=True)]
    if layout.policy.shard_params:
        return ScheduleUnits(tuple(units), {u.name: 0 if u.is_root else 1 for u in units})
    buckets = merge_in_order(units, lambda u: 4 * u.full_numel, EngineOptions(bucket_mb=layout.bucket_mb).bucket_bytes)
    merged = [dataclasses.replace(unit(f"bucket.{i}", sum(u.groups[0].numel for u in b), root=any(u.is_root for u in b),
                                       experts=expert_numel * sum(not u.is_root for u in b)),
                                  blocks=sum(not u.is_root for u in b)) for i, b in enumerate(buckets)]
    return ScheduleUnits(tuple(merged), {u.name: u.blocks or 0 for u in merged})


def replay_options(w: Workload, layout: Layout) -> EngineOptions:
    """The engine knobs the replay models, as the runtime spells them. torchtitan's op-level
    policies are not the engine's: their recompute is priced inside each block's backward."""
    checkpointing = "none" if w.checkpointing in TORCHTITAN_POLICIES else w.checkpointing
    return dataclasses.replace(layout.engine, checkpointing=checkpointing)


def replay_schedule(w: Workload, layout: Layout, units: ScheduleUnits) -> Schedule:
    """The runtime's schedule of one optimizer step of ``w`` on ``layout`` (steady state, no clip)."""
    tp = None
    if layout.tp > 1:
        # An MoE block all-reduces its attention's output alone: its MoE layer is not tp split.
        per_block = MOE_ALL_REDUCES_PER_LAYER if w.shape.n_expert else ALL_REDUCES_PER_LAYER
        tp = TensorParallelSizes(numel=w.tokens * w.shape.hidden, dtype=_dtype(w.compute_bytes, "compute_bytes"),
                                 blocks=w.shape.n_layer, per_block=per_block)
    cp = None
    if layout.cp > 1:  # each block's attention exchanges, sized from the attention's own volumes
        cp = schedule_sizes(layout.cp_attention, blocks=w.shape.n_layer, dtype=_dtype(w.compute_bytes, "compute_bytes"),
                            cp=layout.cp, rows=w.micro_batch, seq=w.seq, q_width=w.shape.hidden // layout.tp,
                            kv_width=w.shape.kv_dim // layout.tp)
    mesh = layout.mesh
    return step_schedule(units.units, policy=layout.policy, mesh=mesh, options=replay_options(w, layout),
                         accum=w.accum, tp=tp, cp=cp)


@dataclasses.dataclass
class Walked:
    """Where the walk left the step: its time before the optimizer, and what it priced besides launches."""

    t: float
    optimizer_share: float
    param_sync_bytes: float
    tp_bytes: float
    ep_bytes: float = 0.0
    ep_s: float = 0.0
    """Seconds compute waited on the ep all-to-alls (all of theirs: nothing overlaps them)."""
    cp_s: float = 0.0
    """Seconds compute waited on the attention's cp exchanges (issued in line: nothing overlaps them)."""


def walk(w: Workload, layout: Layout, d: _Durations, comm: CommLink, host: HostLink) -> Walked:
    """Price the schedule's micro-steps on ``comm`` and ``host``, up to the optimizer's update."""
    units = schedule_units(w, layout)
    schedule = replay_schedule(w, layout, units)
    rebuilds = any(e.op == COMPUTE and e.phase == RECOMPUTE for e in schedule.events)
    walker = _Walker(w, layout, units, d, comm, host, rebuilds=rebuilds)
    for e in schedule.events:
        walker.price(e)
    return walker.out


class _Walker:
    """``walk``'s state: the two timelines' clock (``out.t``), the collectives in flight per unit,
    and what one event of each kind costs."""

    def __init__(self, w: Workload, layout: Layout, units: ScheduleUnits, d: _Durations, comm: CommLink,
                 host: HostLink, *, rebuilds: bool) -> None:
        self.w, self.layout, self.units, self.d, self.comm, self.host = w, layout, units, d, comm, host
        self.sizes = {u.name: u for u in units.units}
        # The block's backward time includes its rebuild; the engine's own checkpointing has it as an
        # event of its own in the schedule, so it is taken out here rather than priced twice.
        self.backward = d.block_bwd - (d.block_recompute if rebuilds else 0.0)
        self.tp_one = 0.0
        if layout.tp > 1:
            self.tp_one = collective_seconds("all_reduce", w.tokens * w.shape.hidden * w.compute_bytes, layout.tp,
                                             comm.hw, spans=False)
        # torchtitan's op-level policies rebuild blocks outside the engine's schedule: their forward
        # all-reduces run again in backward, spread over the blocks.
        self.rebuilt_tp = _torchtitan_rebuilt_all_reduces(w) / w.shape.n_layer if layout.tp > 1 else 0.0
        self.out = Walked(t=0.0, optimizer_share=0.0, param_sync_bytes=0.0, tp_bytes=0.0)
        self.a2a = _AllToAlls(w, layout, comm)
        self.inflight: dict[str, list[Collective]] = {}

    def seconds(self, unit: str, phase: str) -> float:
        d = self.d
        if unit == "":  # stages 0-2: the model outside its buckets' blocks
            return self.w.shape.n_layer * d.block_fwd + d.root_fwd if phase == FORWARD else d.root_bwd
        if self.sizes[unit].is_root and self.layout.policy.shard_params:
            return d.root_fwd if phase == FORWARD else d.root_bwd
        per_block = {FORWARD: d.block_fwd, BACKWARD: self.backward, RECOMPUTE: d.block_recompute}[phase]
        return self.units.blocks[unit] * per_block

    def tp_all_reduces(self, count: float, nbytes: float) -> None:
        out, comm = self.out, self.comm
        out.t += count * self.tp_one
        comm.busy += count * self.tp_one
        comm.wire += count * wire_bytes("all_reduce", nbytes, self.layout.tp)
        out.tp_bytes += count * nbytes

    def price(self, e) -> None:
        """Advance the timelines by one schedule event."""
        out, layout = self.out, self.layout
        if e.op == COMPUTE and e.phase == OPTIMIZER:
            out.optimizer_share += e.share
        elif e.op == COMPUTE:
            self._compute(e)
        elif e.op == WAIT:
            self._wait(e)
        elif e.op == FREE:
            return
        elif e.group == "tp":
            self.tp_all_reduces(1, e.bytes)
        elif e.group == "cp":
            self._cp_exchange(e)
        elif e.op == "all_gather" and e.phase == PARAM_SYNC:
            out.param_sync_bytes += e.bytes
        else:
            out.t, item = _launch(e, layout, self.comm, self.host, self.sizes, out.t)
            self.inflight.setdefault(e.unit, []).append(item)

    def _compute(self, e) -> None:
        """A compute mark: its share of the unit's pass, and the exchanges that block it."""
        w, out, units = self.w, self.out, self.units
        out.t = self.comm.compute(out.t, e.share * self.seconds(e.unit, e.phase))
        if self.a2a.on:  # each MoE block's token exchanges, on the critical path
            # unit "": stages 0-2's whole forward, or the root's backward (no block)
            blocks = (w.shape.n_layer if e.phase == FORWARD else 0) if e.unit == "" else units.blocks[e.unit]
            out.t = self.a2a.price(out.t, e.share * blocks, e.phase, out)
        if self.rebuilt_tp and e.phase == BACKWARD and e.unit:  # a block or bucket (the root holds no block)
            self.tp_all_reduces(e.share * self.rebuilt_tp * units.blocks[e.unit],
                                w.tokens * w.shape.hidden * w.compute_bytes)

    def _wait(self, e) -> None:
        """A wait mark: compute waits for the unit's collectives in flight."""
        out = self.out
        done = self.inflight.pop(e.unit, [])
        for c in done:
            out.t = max(out.t, self.comm.when(c))
        if e.phase == BACKWARD and any(c.op != "all_gather" for c in done):
            # Offload runs without replicas (Layout): one wait per finished reduction.
            self.host.copy_out(sum(g.shard_numel for g in self.sizes[e.unit].groups), out.t)

    def _cp_exchange(self, e) -> None:
        """The attention waits on its cp exchange (issued in line: nothing overlaps it)."""
        out, comm, layout = self.out, self.comm, self.layout
        spans = layout.cp * layout.tp > comm.hw.gpus_per_node
        cp_s = collective_seconds(e.op, e.bytes, layout.cp, comm.hw, spans=spans, world=layout.world)
        out.t, out.cp_s, comm.busy = out.t + cp_s, out.cp_s + cp_s, comm.busy + cp_s
        comm.wire += wire_bytes(e.op, e.bytes, layout.cp)


def _launch(e, layout: Layout, comm: CommLink, host: HostLink, sizes: dict, t: float) -> tuple[float, Collective]:
    """An all-gather or reduction of the schedule launched at ``t`` on its group's stream: (the time
    compute goes on from, the collective in flight)."""
    if e.op == "all_gather" and e.mesh == EXPERTS:  # an expert group: over the ranks holding its experts
        return t, comm.launch("all_gather", e.bytes, layout.expert_group, t, stream="experts")
    if e.op == "all_gather":
        t += host.copy_in(sum(g.shard_numel for g in sizes[e.unit].groups))
        return t, comm.launch("all_gather", e.bytes, layout.shard_group, t)
    if e.group == "replicate":  # synchronous in Unit.finish_reduce: the next wait mark takes it
        return t, comm.launch(e.op, e.bytes, layout.replicas, t, spans=layout.world > comm.hw.gpus_per_node,
                              stream="replicate")
    if e.mesh == EXPERTS:  # an expert group's reduction, on its own group's stream
        return t, comm.launch(e.op, e.bytes, layout.expert_group, t, stream="experts")
    # A reduction: over the shard group, or every data-parallel rank at stage 0.
    group = layout.shard_group if layout.policy.shard_optimizer else layout.dp
    return t, comm.launch(e.op, e.bytes, group, t)


class _AllToAlls:
    """Expert parallelism's token exchanges (zeroshard/parallel/experts/dispatch.py), which the engine's
    schedule does not hold: per MoE block and micro-step, forward exchanges the counts then the
    rows there and the outputs back, backward the two row exchanges reversed, and a checkpoint
    rebuild runs forward's again. Each blocks compute (the layer needs its rows), so it is priced
    like the tp all-reduces: on the ep link (``ep`` consecutive ranks; across nodes when ep
    exceeds a node). The busiest rank receives ``1 + routing_skew`` times its share of rows, so
    both row exchanges take that long; the bytes are the ledger's (what each rank sends, its own
    rows and the skewed ones it returns).

    Under tp each tp rank routes its run of its group's tokens (``tp_tokens.run_of``: ``c =
    ceil(tokens / tp)``, the longest), so the rows are ``c × top_k``, and the layer's tp
    all-gathers (zeroshard/parallel/experts/tp_tokens.py) block compute too, on the tp link: forward the
    outputs, backward the input rows' and the routing weights' grads, ``tp × c`` rows each (the
    ledger's bytes, every run padded to ``c``)."""

    def __init__(self, w: Workload, layout: Layout, comm: CommLink) -> None:
        s = w.shape
        self.on = layout.ep > 1 and s.n_expert > 0
        self.comm, self.ep, self.tp = comm, layout.ep, layout.tp
        routed = run_of(w.tokens, layout.tp, 0)[2]
        own = routed * s.top_k * s.hidden * w.compute_bytes
        self.rows, self.skewed = float(own), (1.0 + w.routing_skew) * own
        self.counts = 8.0 * s.n_expert
        spans = layout.ep > comm.hw.gpus_per_node
        self.exchange = collective_seconds("all_to_all", self.skewed, layout.ep, comm.hw, spans=spans) \
            if self.on else 0.0
        self.count_exchange = collective_seconds("all_to_all", self.counts, layout.ep, comm.hw, spans=spans) \
            if self.on else 0.0
        gathered = layout.tp * routed * w.compute_bytes if self.on and layout.tp > 1 else 0
        self.gather_fwd = float(gathered * s.hidden)
        self.gather_bwd = float(gathered * (s.hidden + s.top_k))
        self.gather_fwd_s = self._gather_seconds(self.gather_fwd)
        self.gather_bwd_s = self._gather_seconds(gathered * s.hidden) + self._gather_seconds(gathered * s.top_k)

    def _gather_seconds(self, nbytes: float) -> float:
        return collective_seconds("all_gather", nbytes, self.tp, self.comm.hw, spans=False) if nbytes else 0.0

    def price(self, t: float, blocks: float, phase: str, out: Walked) -> float:
        forward = phase in (FORWARD, RECOMPUTE)
        seconds = blocks * (2 * self.exchange + (self.count_exchange if forward else 0.0))
        nbytes = blocks * (self.rows + self.skewed + (self.counts if forward else 0.0))
        self.comm.busy += seconds
        self.comm.wire += wire_bytes("all_to_all", nbytes, self.ep)
        self.comm.by_op["all_to_all"] = self.comm.by_op.get("all_to_all", 0.0) + seconds
        out.ep_bytes += nbytes
        out.ep_s += seconds
        gather_s = blocks * (self.gather_fwd_s if forward else self.gather_bwd_s)
        if gather_s:
            gathered = blocks * (self.gather_fwd if forward else self.gather_bwd)
            self.comm.busy += gather_s
            self.comm.wire += wire_bytes("all_gather", gathered, self.tp)
            self.comm.by_op["all_gather"] = self.comm.by_op.get("all_gather", 0.0) + gather_s
            out.tp_bytes += gathered
        return t + seconds + gather_s


def _torchtitan_rebuilt_all_reduces(w: Workload) -> int:
    """TP all-reduces torchtitan's op-level policies run again in a micro-step's backward: "full"
    checkpoints each block, whose rebuild stops before its last row-wise output (nothing saves it);
    "op" reruns both. zeroshard's own policies are in the step schedule."""
    L = w.shape.n_layer
    return {"full": L, "op": 2 * L}.get(w.checkpointing, 0)
