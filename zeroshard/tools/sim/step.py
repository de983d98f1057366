"""Time one optimizer step on two timelines, compute and communication: the step the runtime runs.

What the step does, and in which order, is not restated here: zeroshard/tools/sim/replay.py walks the
runtime's step schedule (zeroshard/runtime/schedule.py: gathers with their prefetch and
resharding, reductions in the engine's order with its in-flight cap and buckets, replica
all-reduces, checkpoint rebuilds, tp all-reduces, accumulation inside ``no_sync``, the post-step
gathers) and prices each event. This module holds what the pricing needs:

- ``Layout``: the mesh and the engine knobs the replay models (``SIMULATED_KNOBS``);
- the seconds of each unit's passes (``_Durations``): measured on this host by ``plan calibrate``,
  or matmuls and attention at their efficiencies and the rest at memory bandwidth. With a tp
  mesh dim (``Layout.tp``) each block's matmuls and attention are split over tp consecutive ranks
  of a node (Megatron's column/row split; elementwise work is taken as whole, a bound), and ZeRO
  shards each rank's tp-local params over the data-parallel ranks (every tp-th rank);
- offload (``Layout.offload``, the runtime's ``OffloadPolicy``): fp32 masters and AdamW state live
  in host memory. Each finished reduction's fp32 grad shard is copied out over the host link,
  asynchronously (pinned), one copy at a time; the optimizer waits for them all, then steps on
  the CPU at host memory bandwidth (disk: also reading and writing its state files, prefetched a
  slice ahead). Masters come back synchronously, on the compute stream, before each gather of a
  unit's own slice at stage 3, before the post-step all-gather at stages 1-2, and for the whole
  model after the step at stage 0;
- the optimizer's update at the measured or modelled AdamW rate.

Collectives of one process group share one stream in launch order (they compete for the same
links), as on one NCCL stream; with a measured concurrency figure (``Hardware.concurrency``, gloo
on a CPU host) every collective in flight shares one pool instead (see ``CommLink``). Anything compute
had to wait for is exposed; collective work done while compute ran is hidden, and on a host where
both share the cores it costs compute its measured contention.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from zeroshard.comm.dims import ParallelDims
from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.options import EngineOptions
from zeroshard.tools.sim.hardware import Hardware
from zeroshard.tools.sim.measured import pick_compute, pick_concurrency
from zeroshard.tools.sim.network import collective_seconds, wire_bytes
from zeroshard.tools.sim.replay import walk
from zeroshard.tools.sim.workload import Workload

ADAMW_BYTES_PER_PARAM = 34
"""fp32 AdamW update moves param, grad, two moments in (16 B) and param, moments out (12 B), plus the
compute-dtype copy of the param (read 4, write 2)."""


HOST_ADAMW_BYTES_PER_PARAM = 28
"""AdamW on the host over offloaded fp32 state: param, grad, two moments in (16 B), param and moments
out (12 B). The compute-dtype copy is made on the device from the master sent back."""
DISK_STATE_BYTES_PER_PARAM = 12
"""What disk offload keeps in files per param (fp32 master and AdamW's two moments): read, stepped,
written back."""
MASTER_BYTES = 4
"""Offload's masters and reduced grads cross the host link in fp32."""

_ENGINE = EngineOptions()
"""The runtime's defaults (prefetch window, resharding, bucket size, no offload), read, not restated."""

SIMULATED_KNOBS = ("checkpointing", "offload", "bucket_mb", "prefetch", "reshard_after_forward")
"""The engine's knobs the step replay models (checkpointing through the workload, the rest through
``Layout``); `plan time` refuses any other knob by name."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """One stage's layout (``dims``: its ranks, tp, ep and shard groups; every size below is read
    from it) and the engine knobs the replay models. ``Layout.of(world=, stage=, tp=, ...)`` spells
    the degrees directly."""

    dims: ParallelDims
    """The mesh (zeroshard/comm/dims.py): ``world`` counts every rank of the stage; ``world / tp``
    are data parallel; ``dims.shard`` of them shard each buffer when the stage shards (hybrid when
    fewer than dp); ``ep`` consecutive ranks of dp × tp split each MoE block's experts, each
    sharded over the ``world / ep`` that hold it, tokens going to them by all-to-all."""
    stage: int
    engine: EngineOptions = _ENGINE
    """The engine's knobs, the runtime's own object: the replay reads its prefetch window, resharding,
    bucket size and offload (``SIMULATED_KNOBS``)."""
    param_bytes: int = 2
    reduce_bytes: int = 4
    cp_attention: str = "ring"
    """With ``dims.cp > 1``: the attention scheme whose exchanges the replay times."""

    @classmethod
    def of(cls, *, world: int, stage: int, shards: int | None = None, tp: int = 1, ep: int = 1,
           param_bytes: int = 2, reduce_bytes: int = 4, cp: int = 1, cp_attention: str = "ring",
           **knobs: Any) -> Layout:
        """A layout of ``world`` ranks, ``tp`` per block, buffers sharded over ``shards`` of the data-parallel
        ranks (None: all of them) and experts split over ``ep``; ``knobs`` are the engine's, spelled flat
        (``prefetch=2``, ``offload="cpu"``)."""
        own = tuple(k for k in SIMULATED_KNOBS if k != "checkpointing")  # that one is the workload's
        unknown = sorted(set(knobs) - set(own))
        if unknown:
            raise TypeError(f"Layout.of got unknown keywords {unknown}; the layout's knobs are {', '.join(own)}")
        return cls(dims=ParallelDims.of(world, tp=tp, shard=shards, ep=ep, cp=cp), stage=stage,
                   engine=EngineOptions.from_flat(knobs), param_bytes=param_bytes, reduce_bytes=reduce_bytes,
                   cp_attention=cp_attention)

    @property
    def prefetch(self) -> int:
        return self.engine.prefetch

    @property
    def reshard_after_forward(self) -> bool:
        return self.engine.reshard_after_forward

    @property
    def bucket_mb(self) -> float:
        return self.engine.bucket_mb

    @property
    def offload(self) -> str:
        """Where masters and optimizer state live: none, cpu or disk (``zeroshard.runtime.offload``)."""
        return self.engine.offload.kind

    def __post_init__(self) -> None:
        StagePolicy(self.stage)  # validates
        if not isinstance(self.dims, ParallelDims) or self.dims.pp != 1:
            raise ValueError(f"a Layout is one pipeline stage's: give it a ParallelDims with pp=1, got {self.dims!r}")
        if self.offload != "none" and self.hybrid:
            raise ValueError("offload is simulated over the whole world, as the planner prices it; drop the "
                             "shard size or the offload")

    @property
    def world(self) -> int:
        return self.dims.world

    @property
    def tp(self) -> int:
        """Tensor-parallel degree: consecutive ranks (within a node) each block is split over."""
        return self.dims.tp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those that shard and reduce together."""
        return self.dims.dp

    @property
    def policy(self) -> StagePolicy:
        return StagePolicy(self.stage)

    @property
    def cp(self) -> int:
        """Ranks each sequence is split over."""
        return self.dims.cp

    @property
    def shard_group(self) -> int:
        """Ranks ZeRO shards a buffer over: shard x cp."""
        return self.dims.zero_shard if self.policy.shard_optimizer else 1

    @property
    def mesh(self) -> ParallelDims:
        """The dims the step schedule runs on: a stage that shards nothing has shard groups of one."""
        return self.dims if self.policy.shard_optimizer else self.dims.with_shard(1)

    @property
    def hybrid(self) -> bool:
        """Sharded over groups smaller than the data-parallel ranks, replicated across them."""
        return self.policy.shard_optimizer and self.dims.hybrid

    @property
    def replicas(self) -> int:
        return self.dims.grad_dp // self.shard_group

    @property
    def expert_group(self) -> int:
        """Ranks an expert group is sharded over and reduced on: the ``world / ep`` holding the same
        experts (``dp / ep`` without tp; every data-parallel rank without ep)."""
        return self.dims.edp if self.ep > 1 else self.dp


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepResult:
    step_s: float
    compute_s: float
    optimizer_s: float
    comm_s: float
    exposed_comm_s: float
    """Data-parallel and tp communication compute waited for (the ep all-to-alls are apart, in
    ``breakdown``: compute always waits for them)."""
    tokens_per_s_per_gpu: float
    mfu: float
    wire_bytes: float
    """Bytes each rank sends per step (ring volumes)."""
    breakdown: dict[str, float]
    hidden_comm_s: float = 0.0
    """Seconds of collective work done while compute ran (from the replay's timeline)."""
    tp_bytes: float = 0.0
    """Bytes of the tp collectives' buffers per step on each rank (the all-reduces, and under ep the MoE
    layers' all-gathers): what the runtime's ledger records for group "tp" (a ring all-reduce sends
    2(tp-1)/tp of it, which ``wire_bytes`` counts)."""
    ep_bytes: float = 0.0
    """Bytes of the ep all-to-alls per step on the busiest rank, as the runtime's ledger records them
    (each by what the rank sends): the same figure as the planner's ep rows."""

    def dominant(self) -> str:
        return max(self.breakdown, key=lambda k: self.breakdown[k])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"dominant": self.dominant()}


@dataclasses.dataclass(eq=False)
class Collective:
    """One collective on the replay's communication timeline."""

    op: str
    at: float
    """When the program launched it."""
    work: float
    """Seconds it takes alone."""
    stream: str
    end: float | None = None
    nbytes: float = 0.0
    """Its buffer: what the runtime's ledger and step schedule count for it."""


class CommLink:
    """The host's communication, and the compute spans it may run under.

    Without a measured concurrency figure each stream (the shard group's, the replicate group's)
    runs its collectives one at a time in launch order, as one NCCL stream does. With one
    (``Hardware.concurrency``: gloo's worker threads on a CPU host) every collective in flight,
    of any group, shares one pool: k at once each progress at 1 / (k * factor(k)) of their solo
    speed. Their ends then depend on later launches, so the pool is solved again whenever one is
    asked for after a launch; the replay only asks when compute waits, and compute launches
    nothing while it waits, so an end it was given never changes afterwards.
    """

    def __init__(self, hw: Hardware, layout: Layout) -> None:
        self.hw, self.layout = hw, layout
        group = layout.shard_group if layout.shard_group > 1 else layout.dp  # DDP reduces over every rank
        self.shared = pick_concurrency(hw.concurrency, layout.world, group)
        self.ops: list[Collective] = []
        self.free_at: dict[str, float] = {}
        self.compute_spans: list[tuple[float, float]] = []
        self.busy = 0.0
        self.wire = 0.0
        self.by_op: dict[str, float] = {}
        self._segments: list[tuple[float, float, list[Collective], float]] = []
        self._dirty = False

    def launch(self, op: str, nbytes: float, group: int, at: float, spans: bool | None = None,
               stream: str = "shard") -> Collective:
        """Launch ``op`` at ``at``; ``when`` gives its end."""
        if spans is None and self.layout.tp > 1:  # a data-parallel group takes every tp-th rank
            spans = group * self.layout.tp > self.hw.gpus_per_node
        seconds = collective_seconds(op, nbytes, group, self.hw, spans=spans, world=self.layout.world)
        item = Collective(op, at, seconds, stream, nbytes=nbytes)
        if self.shared is None:
            start = max(self.free_at.get(stream, 0.0), at)
            item.end = self.free_at[stream] = start + seconds
            self._segments.append((start, item.end, [item], 1.0))
        self._dirty = self.shared is not None
        self.ops.append(item)
        self.busy += seconds
        self.by_op[op] = self.by_op.get(op, 0.0) + seconds
        self.wire += wire_bytes(op, nbytes, group)
        return item

    def when(self, item: Collective | float) -> float:
        """The end of a launched collective (a plain time is returned as is)."""
        if isinstance(item, float):
            return item
        if self._dirty:
            self._solve()
        assert item.end is not None
        return item.end

    def compute(self, start: float, seconds: float) -> float:
        """Record compute running from ``start``; returns its end."""
        if seconds > 0:
            self.compute_spans.append((start, start + seconds))
        return start + seconds

    def _solve(self) -> None:
        """Processor sharing over every collective launched so far."""
        assert self.shared is not None
        shared, todo = self.shared, sorted(self.ops, key=lambda o: o.at)
        self._segments = []
        left = {id(o): o.work for o in todo}
        active: list[Collective] = []
        t, i = (todo[0].at if todo else 0.0), 0
        while i < len(todo) or active:
            while i < len(todo) and todo[i].at <= t:
                active.append(todo[i])
                i += 1
            if not active:
                t = todo[i].at
                continue
            rate = 1.0 / (len(active) * shared.factor(len(active)))
            nxt = min(t + min(left[id(o)] for o in active) / rate, todo[i].at if i < len(todo) else float("inf"))
            self._segments.append((t, nxt, list(active), rate))
            for o in active:
                left[id(o)] -= (nxt - t) * rate
            t = nxt
            for o in [o for o in active if left[id(o)] <= 1e-12 * max(1.0, o.work)]:
                o.end = t
                active.remove(o)
        self._dirty = False

    def under_compute(self) -> dict[str, float]:
        """Per op kind, the solo seconds of collective work done while compute ran."""
        if self._dirty:
            self._solve()
        spans, out = sorted(self.compute_spans), dict[str, float]()
        for t0, t1, items, rate in self._segments:
            seconds = _overlap(t0, t1, spans) * rate
            for o in items:
                out[o.op] = out.get(o.op, 0.0) + seconds
        return out


class HostLink:
    """Offload's traffic between a GPU and host memory (nothing without offload): the fp32 grad
    shards going out, asynchronously (pinned) and one after another on the copy engine, and the
    masters coming back synchronously on the compute stream, which waits for them."""

    def __init__(self, hw: Hardware, layout: Layout) -> None:
        self.on = layout.offload != "none"
        self.bandwidth = hw.offload_figure("host_link_bandwidth", layout.offload) if self.on else 0.0
        self.free_at = 0.0
        self.blocking = 0.0
        """Seconds compute waited on the link: copies back, and the optimizer's wait for copies out."""

    def _seconds(self, params: float) -> float:
        return params * MASTER_BYTES / self.bandwidth if self.on else 0.0

    def copy_out(self, params: float, at: float) -> None:
        """A reduced grad shard of ``params`` elements leaves for the host when its reduction is done."""
        self.free_at = max(at, self.free_at) + self._seconds(params)

    def copy_in(self, params: float) -> float:
        """Seconds compute is held while ``params`` masters are copied back to the device."""
        seconds = self._seconds(params)
        self.blocking += seconds
        return seconds

    def drain(self, t: float) -> float:
        """When every copy out has landed (the host optimizer reads those grads)."""
        end = max(t, self.free_at) if self.on else t
        self.blocking += end - t
        return end


def _overlap(t0: float, t1: float, spans: list[tuple[float, float]]) -> float:
    """Seconds of [t0, t1] covered by the sorted, disjoint ``spans``."""
    total = 0.0
    for a, b in spans[max(0, bisect.bisect_right(spans, (t0, t0)) - 1):]:
        if a >= t1:
            break
        total += max(0.0, min(b, t1) - max(a, t0))
    return total


@dataclasses.dataclass(frozen=True)
class _Durations:
    block_fwd: float
    block_bwd: float
    root_fwd: float
    root_bwd: float
    parts: dict[str, float]
    block_recompute: float = 0.0
    """The share of ``block_bwd`` that reruns the block's forward under checkpointing."""


def _measured_durations(w: Workload, hw: Hardware, world: int, synced_per_unit: bool) -> _Durations:
    """Seconds per unit from ``hw.compute`` (timed on this model), scaled by tokens when the
    workload's micro-batch differs from the timed one. The parts split as the timing did.

    A step lasts as long as its slowest rank. With ``synced_per_unit`` (params sharded: every block
    waits on its own gather, which every rank of the group must have launched) each block takes its
    slowest rank's time where that was measured. Otherwise ranks meet only at the step's end:
    blocks keep the mean over ranks, and the root takes the slowest rank's whole forward plus
    backward less them, so the skew is paid once a step, not once a block."""
    c = pick_compute(hw.compute, w.shape.name, w.shape.vocab, world)
    scale = w.tokens / c.tokens
    fwd, bwd = c.block_forward_s, c.block_backward_s
    root_f, root_b = c.root_forward_s, c.root_backward_s
    if synced_per_unit:
        fwd = c.block_forward_slowest_s if c.block_forward_slowest_s is not None else fwd
        bwd = c.block_backward_slowest_s if c.block_backward_slowest_s is not None else bwd
    elif c.root_slowest_s is not None:  # the root runs its forward and backward back to back
        root_b = max(0.0, c.root_slowest_s - root_f)
    bf, bb = fwd * scale, bwd * scale
    rf, rb = root_f * scale, root_b * scale
    recompute = bf * w.recompute_fraction()[0] if w.checkpointing != "none" else 0.0
    L = w.shape.n_layer
    parts = {"blocks (measured)": L * (bf + bb), "root (measured)": rf + rb, "recompute": L * recompute}
    if synced_per_unit:
        # Stage 3's per-unit host work (hooks, gathers' copy-in, reduction bookkeeping), as measured:
        # it does not scale with tokens, so it is what keeps small units from being free.
        hf, hb = c.unit_host_forward_s, c.unit_host_backward_s
        bf, bb, rf, rb = bf + hf, bb + hb, rf + hf, rb + hb
        parts["runtime host (measured)"] = (L + 1) * (hf + hb)
    return _Durations(block_fwd=bf, block_bwd=bb + recompute, root_fwd=rf, root_bwd=rb, parts=parts,
                      block_recompute=recompute)


def with_cp(d: _Durations, layout: Layout) -> _Durations:
    """A cp rank computes 1/cp of its micro-batch (every rank's causal attention is balanced: ring's
    load-balanced chunks, Ulysses' head slices). Its blocks' attention exchanges are the step
    schedule's cp events, which the walk prices in line (zeroshard/tools/sim/replay.py)."""
    cp = layout.cp
    return _Durations(block_fwd=d.block_fwd / cp, block_bwd=d.block_bwd / cp, root_fwd=d.root_fwd / cp,
                      root_bwd=d.root_bwd / cp, parts={k: v / cp for k, v in d.parts.items()},
                      block_recompute=d.block_recompute / cp)


def _durations(w: Workload, hw: Hardware, tp: int = 1, world: int = 1, synced_per_unit: bool = False,
               ep: int = 1) -> _Durations:
    """Seconds per unit: measured ones when ``hw`` has them, else matmuls and attention at their
    efficiencies (split over ``tp`` ranks; an MoE layer's experts only under ep, where each tp
    rank routes its run of the tokens), the rest at HBM speed."""
    if hw.compute and tp == 1:
        return _measured_durations(w, hw, world, synced_per_unit)
    gemm, attn = hw.peak_flops * hw.gemm_efficiency, hw.peak_flops * hw.attention_efficiency
    g_f = w.block_gemm_flops_on(tp, experts_split=ep > 1) / gemm
    a_f = w.block_attention_flops / attn / tp
    e_f = w.block_elementwise_bytes / hw.hbm_bandwidth
    frac_g, frac_a = w.recompute_fraction()
    # Any checkpointing replays the block's elementwise ops (they are never on a save list).
    recompute = frac_g * g_f + frac_a * a_f + (e_f if w.checkpointing != "none" else 0.0)
    root_g = w.root_gemm_flops / gemm
    root_e = w.root_elementwise_bytes / hw.hbm_bandwidth
    L = w.shape.n_layer
    parts = {"matmul": 3 * (L * g_f + root_g), "attention": 3 * L * a_f, "memory-bound": 3 * (L * e_f + root_e),
             "recompute": L * recompute}
    return _Durations(block_fwd=g_f + a_f + e_f, block_bwd=2 * (g_f + a_f + e_f) + recompute,
                      root_fwd=root_g + root_e, root_bwd=2 * (root_g + root_e), parts=parts,
                      block_recompute=recompute)


def simulate(w: Workload, hw: Hardware, layout: Layout) -> StepResult:
    """One optimizer step of ``w`` on ``layout`` over ``hw``: ``w.accum`` micro-steps, then the update."""
    return _replay(w, hw, layout)[0]


def replayed_collectives(w: Workload, hw: Hardware, layout: Layout) -> list[tuple[str, str, float]]:
    """(op, stream, buffer bytes) of each data-parallel collective the replay launches, in launch
    order: what a test compares with the runtime's step schedule (the tp all-reduces are priced in
    aggregate, not launched)."""
    return [(c.op, c.stream, c.nbytes) for c in _replay(w, hw, layout)[1].ops]


def _replay(w: Workload, hw: Hardware, layout: Layout) -> tuple[StepResult, CommLink]:
    d = _durations(w, hw, layout.tp, layout.world, synced_per_unit=layout.policy.shard_params, ep=layout.ep)
    if layout.cp > 1:
        d = with_cp(d, layout)
    pol, s = layout.policy, w.shape
    comm, host = CommLink(hw, layout), HostLink(hw, layout)
    walked = walk(w, layout, d, comm, host)
    compute = w.accum * (s.n_layer * (d.block_fwd + d.block_bwd) + d.root_fwd + d.root_bwd)
    group = layout.shard_group  # 1 at stage 0
    params = _shard_params(w, layout) * group  # (what a rank's optimizer steps, times the shards)
    t = host.drain(walked.t)
    optimizer = _optimizer_seconds(w, hw, layout, params / group) * walked.optimizer_share
    t = comm.compute(t, optimizer)
    if not pol.shard_params:  # offloaded masters back to the device: this rank's slice (all of it at stage 0)
        t += host.copy_in(params / group)
    if walked.param_sync_bytes:
        t = comm.when(comm.launch("all_gather", walked.param_sync_bytes, group, t))
    exposed = max(0.0, t - compute - optimizer - host.blocking - walked.ep_s - walked.cp_s)
    # Communication that runs under compute still takes the measured share of the cores from it.
    under = comm.under_compute()
    stolen = _contention_seconds(w, hw, layout, under)
    t += stolen
    tokens = w.tokens * w.accum / layout.tp / layout.cp  # a tp (and a cp) group shares its micro-batch
    breakdown = {k: v * w.accum for k, v in d.parts.items()} | {"optimizer": optimizer, "exposed comm": exposed}
    if stolen:
        breakdown["comm contention"] = stolen
    if host.on:
        breakdown["host copies (offload)"] = host.blocking
    if walked.ep_s:
        breakdown["all-to-all (ep)"] = walked.ep_s
    if walked.cp_s:
        breakdown["attention exchange (cp)"] = walked.cp_s
    return StepResult(step_s=t, compute_s=compute, optimizer_s=optimizer, comm_s=comm.busy, exposed_comm_s=exposed,
                      tokens_per_s_per_gpu=tokens / t, mfu=tokens * w.mfu_flops_per_token() / t / hw.peak_flops,
                      wire_bytes=comm.wire, breakdown=breakdown, hidden_comm_s=sum(under.values()),
                      tp_bytes=walked.tp_bytes, ep_bytes=walked.ep_bytes), comm


def _contention_seconds(w: Workload, hw: Hardware, layout: Layout, under: dict[str, float]) -> float:
    """What communication under compute costs it: each collective's seconds under compute (from
    the replay's own timeline) times its measured contention, or ``hw.contention`` without them."""
    if not hw.compute:
        return hw.contention * sum(under.values())
    c = pick_compute(hw.compute, w.shape.name, w.shape.vocab, layout.world)
    return sum(c.contention(op) * seconds for op, seconds in under.items())


def _optimizer_seconds(w: Workload, hw: Hardware, layout: Layout, params: float) -> float:
    """AdamW over ``params`` local params: on the device, or with offload on the host CPU
    (memory-bound at host bandwidth; a calibrated CPU host's measured rate, the same CPU); disk
    offload also reads and writes its state files, a slice prefetched while the previous one steps,
    so the slower of the two sets the pace after the first slice's read."""
    if layout.offload == "none" or hw.compute:
        return params * _optimizer_s_per_param(w, hw, layout.world)
    cpu = params * HOST_ADAMW_BYTES_PER_PARAM / hw.offload_figure("host_memory_bandwidth", layout.offload)
    if layout.offload == "cpu":
        return cpu
    disk = hw.offload_figure("disk_bandwidth", layout.offload)
    state = params * DISK_STATE_BYTES_PER_PARAM
    first = min(params, _ENGINE.offload.slice_numel) * DISK_STATE_BYTES_PER_PARAM / disk  # the runtime's slice
    return max(cpu, 2 * state / disk) + first


def _optimizer_s_per_param(w: Workload, hw: Hardware, world: int) -> float:
    """Measured AdamW seconds per param when ``hw`` has them for this model, else bytes over HBM bandwidth."""
    if hw.compute:
        return pick_compute(hw.compute, w.shape.name, w.shape.vocab, world).optimizer_s_per_param
    return ADAMW_BYTES_PER_PARAM / hw.hbm_bandwidth


def _shard_params(w: Workload, layout: Layout) -> float:
    """Params of each rank's ZeRO shards: its tp part of every block (taken as wholly split) and the
    root over the shard group, its ep block of the experts over the ranks that hold them."""
    s = w.shape
    dense = s.root_params + s.n_layer * (s.block_params - s.expert_params) / layout.tp
    experts = s.n_layer * s.expert_params / layout.ep  # never tp split
    return dense / layout.shard_group + experts / (layout.expert_group if layout.policy.shard_optimizer else 1)
