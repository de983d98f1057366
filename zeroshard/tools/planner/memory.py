"""The estimator: per-rank bytes by component, for every stage side by side.

Two accountings:

- ``runtime`` (models): what *this* runtime allocates, group by group, from the same layout code
  ``zs.shard`` runs (docs/runtime.md, "Memory contract per rank"). Padding, frozen params, tied
  weights, the separate fp32 reduced-grad shard from stage 1, and masters that alias fp32 params
  are all as the runtime does them.
- ``textbook`` (a bare parameter count): the ZeRO paper's table, 2Ψ + 2Ψ + 12Ψ split per stage,
  with the optimizer's bytes still discovered by running it, because "12 bytes for Adam" holds only
  for fp32 moments and master over 16-bit params.

docs/planner.md gives the formulas.
"""

from __future__ import annotations

import dataclasses

import torch

from zeroshard.runtime.offload.policy import OffloadPolicy
from zeroshard.tools.planner import comm
from zeroshard.tools.planner.activations import ActivationEstimate, alive_activations
from zeroshard.tools.planner.experts import ExpertSplit, ep_collectives
from zeroshard.tools.planner.inventory import CommUnit, Inventory
from zeroshard.tools.planner.optim_probe import OptimStateCost, probe
from zeroshard.tools.planner.owner_state import PerTensorParams, exchange_collective, optimizer_per_rank
from zeroshard.tools.planner.result import Components, LayoutPlan
from zeroshard.tools.planner.spec import STAGE_NAMES, PlanSpec
# The engine's constants, imported: one value, not two copies.
from zeroshard.comm.quant import CommQuant
from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.clip import SQUARE_CHUNK
from zeroshard.runtime.optim import PIPELINE_MIN_NUMEL
from zeroshard.runtime.schedule import step_schedule
from zeroshard.comm.dims import ParallelDims
from zeroshard.runtime.schedule_events import ContextParallelSizes, GroupSizes, UnitSizes


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype, device="meta").element_size()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Transient:
    """Memory that comes and goes within a step, and when it is there."""

    buckets: int = 0
    """Peak of full-size grad memory in flight besides the grads kept for the step."""
    early: int = 0
    """Grad buffers already live when backward starts (next to every saved activation)."""
    during: int = 0
    """Bytes above the model states at backward's worst moment after its start: a unit's grads being
    collected or reduced, with the activations, gathered params and grad shards of that moment, or
    backward's end."""
    window: int = 0
    start_window: int = 0
    """Stage 3: the full params gathered when backward starts (what forward left gathered, before
    backward's prefetch): the window next to every saved activation."""
    scratch: int = 0
    """Optimizer step temporaries (the largest one unit's step makes)."""
    step: int = 0
    """Bytes above the model states at the optimizer step's worst moment: a unit's scratch next to
    the grad buffers of the reductions still running when its step starts."""
    late_grads: int = 0
    """Part of the grads that the reductions create during backward (reduced copies and shards),
    so it is not there yet when backward starts."""
    host_late: int = 0
    """Offloaded: the host grads the reductions create during backward (absent at its start)."""
    during_combined: int = 0
    """Offloaded: ``during`` with the host grads counted as they are created, over device and host
    states together (what one memory holds on a CPU run)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _UnitGrads:
    """One comm unit's share of what backward allocates and frees, in reduction order."""

    late: int = 0
    """Grads its reduction creates (the reduced copy or shard), kept for the step."""
    activations: int = 0
    """Saved (and rebuilt) activations still alive when its last grad arrives."""
    window: int = 0
    """Stage 3: full params gathered while its grads complete (itself, the units prefetched, the root)."""
    per_param: int = 0
    """Stages 2-3: its grads as autograd makes them (compute dtype), kept on the params until the unit
    is complete."""
    flat: int = 0
    """Stages 2-3: the flat reduce-dtype buffer they are collected into, until the reduction is reaped."""
    reduced: int = 0
    """Its reduction's output while that is a second shard (added into an existing one, or cast)."""
    cast: int = 0
    """Stage 1: a reduce-dtype copy of its persistent grads, fed to the reduce-scatter."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
    """One layout to plan: a stage, how many ranks shard each buffer, and where masters and
    optimizer state live (the runtime's offload kind: none, cpu or disk)."""

    name: str
    stage: int
    shards: int
    offload: str = "none"

    @property
    def policy(self) -> StagePolicy:
        return StagePolicy(self.stage)


def variants(spec: PlanSpec) -> list[Variant]:
    """DDP and ZeRO-1/2/3 over every data-parallel rank, plus hybrid and offload variants when asked."""
    out = [Variant(name=STAGE_NAMES[s], stage=s, shards=1 if s == 0 else spec.zero_dp) for s in range(4)]
    if spec.hybrid and spec.shard_size is not None:  # hybrid means a shard size below the world
        out += [Variant(name=f"{STAGE_NAMES[s]}_hybrid", stage=s, shards=spec.shard_size * spec.cp) for s in (1, 2, 3)]
    if spec.offload != "none":  # zs.shard offloads at every stage
        out += [Variant(name=f"{STAGE_NAMES[s]}_offload", stage=s, shards=1 if s == 0 else spec.zero_dp,
                        offload=spec.offload) for s in range(4)]
    return out


def _textbook_offload(states: dict[str, int], v: Variant) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) of the textbook table: offload moves the master and optimizer state, and from
    stage 2 the grad shard the host step reads."""
    if v.offload == "none":
        return states, {}
    host = {"master": states["master"], "optimizer": states["optimizer"],
            "grads": states["grads"] if v.policy.transient_grads else 0}
    return {k: value - host.get(k, 0) for k, value in states.items()}, host


class Estimator:
    """Plans every layout of one spec, for a model inventory or a bare parameter count."""

    def __init__(self, spec: PlanSpec, *, inventory: Inventory | None = None, psi: int = 0, frozen: int = 0,
                 activations: ActivationEstimate | None = None, foreach: bool = True,
                 gpus_per_node: int | None = None, reduce_in_place: bool = False, host_is_device: bool = False,
                 tp_collectives: tuple[comm.Collective, ...] = (), comm_quant: CommQuant | None = None,
                 experts: ExpertSplit | None = None, per_tensor: PerTensorParams | None = None,
                 cp_sizes: ContextParallelSizes | None = None) -> None:
        self.spec = spec
        self.cp_sizes = cp_sizes  # the blocks' cp exchanges, which the step schedule lists
        self.per_tensor = per_tensor  # params stepped whole on owner ranks (owner_state.py)
        self.experts = experts or ExpertSplit()
        # The engine finishes the oldest reduction while more than this many are pending; with 0,
        # each launch first finishes the one before it, so one is still in flight.
        self.max_inflight = max(1, spec.engine.max_inflight_reductions)
        # gloo reduces stage 2-3 grads where autograd left them (collectives.reduce_to_owners), with
        # no flat buffer, when they are already in the reduce dtype; NCCL collects them first.
        self.reduce_in_place = reduce_in_place
        # On a CPU run, "host" is the device's own memory: copies to the host are no-ops (the runtime's
        # .to(master device)), so a reduced grad may stay the device buffer, and the host step's
        # scratch lands in the same memory as everything else.
        self.host_is_device = host_is_device
        self.tp_collectives = tp_collectives  # per step, the same for every layout (zeroshard.tools.planner.tp)
        self.comm = comm_quant  # quantized communication, where the runtime applies it (model mode)
        self.gpus_per_node = gpus_per_node
        self.inventory = inventory
        self.psi, self.frozen = psi, frozen
        self.act = activations
        self.foreach = foreach
        self.master_dtypes = inventory.dtypes if inventory else {torch.float32}
        # With the Muon recipe the params off Muon step on AdamW, with the run's own options.
        cls, kwargs = (spec.optimizer, spec.optimizer_kwargs) if per_tensor is None or \
            per_tensor.elementwise is spec.optimizer else (per_tensor.elementwise, {})
        self.costs = {d: probe(cls, d, kwargs) for d in sorted(self.master_dtypes, key=str)}

    def compute(self, dtype: torch.dtype) -> torch.dtype:
        return self.spec.mp.compute_dtype(dtype)

    def reduce(self, dtype: torch.dtype) -> torch.dtype:
        return self.spec.mp.reduction_dtype(dtype)

    # -- one layout ---------------------------------------------------------------------------
    def layout(self, v: Variant) -> LayoutPlan:
        units: tuple[CommUnit, ...] = ()
        if self.inventory is None:
            states, t, padded, _ = self._textbook(v)
            states, host = _textbook_offload(states, v)
            if v.offload != "none":  # the step runs on the host, scratch too
                t = dataclasses.replace(t, scratch=0, step=0)
        else:
            units = self.inventory.comm_units(stage=v.stage, shards=v.shards, bucket_bytes=self._bucket_bytes)
            states, host, t = self._runtime_states(v, units)
        activations = self.act.total if self.act else 0
        largest_grad = self._largest_param_grad()
        # An MoE layer's backward all-to-all buffers (ep > 1) live inside the layer, next to its
        # backward temporaries: counted with a block's. (Forward's four are next to fewer saved
        # activations than backward's start holds.)
        a2a = self._all_to_all_buffers(backward=True)
        backward_ws = max(self.act.head, self.act.block + a2a) if self.act else a2a
        backward_ws += largest_grad
        # At backward's start: every saved activation and, at the larger of the two moments, the
        # loss head's gradients or the first segment rebuilt with one block's gradients (recompute
        # is 0 without checkpointing, when this is saved + workspace).
        start = (self.act.saved + max(self.act.head, self.act.recompute + self.act.block + a2a) if self.act
                 else a2a) + largest_grad
        # Each component is reported at its own peak; the step's peak is the largest of three moments:
        # backward's start (every saved activation, the window, backward temporaries, but not yet
        # the grads the reductions create), backward's worst later moment (``Transient.during``: at
        # stages 2-3 a unit's grads being collected into their flat buffer while the units before
        # it still reduce, next to the activations, gathered params and grad shards of that moment;
        # at stages 0-1 backward's end, every grad and cast copy there; see ``_backward``), and
        # optimizer.step (a unit's scratch, next to the reductions still running; ``_step``). What
        # the components over-count together is the overlap.
        states_total = sum(states.values())
        # The step's global grad norm (clip's or the guard's): a float64 copy of one grad chunk at a time.
        norm = 8 * min(SQUARE_CHUNK, max((g.shard_numel if v.policy.shard_optimizer else g.numel for u in units
                                          for g in u.groups if g.trainable), default=0)) if self.inventory else 0
        phases = (states_total - t.late_grads + start + t.start_window + t.early,
                  states_total + t.during,
                  states_total + max(t.step, norm))
        workspace = max(backward_ws, t.scratch, norm)
        allocated = max(phases)
        overlap = states_total + activations + t.window + t.buckets + workspace - allocated
        device = Components(**states, activations=activations, window=t.window, buckets=t.buckets,
                            workspace=workspace, headroom=int(round(self.spec.headroom * allocated)), overlap=overlap)
        # Device and host together at the worst moment: what a CPU run, where they are one memory, measures.
        host_total = sum(host.values())
        during = t.during_combined if v.offload != "none" else t.during
        combined = max(phases[0] + host_total - t.host_late, states_total + host_total + during,
                       phases[2] + host_total)
        collectives = self._collectives(v, units, padded if self.inventory is None else 0) + self.tp_collectives \
            + self._ep_collectives()
        return LayoutPlan(name=v.name, stage=v.stage, shard_size=v.shards, replicas=self.spec.zero_dp // v.shards,
                          offload=v.offload, checkpointing=str(self.spec.checkpointing), device=device,
                          host_bytes=host_total, host=host, combined_peak=combined, collectives=collectives,
                          experts=self._expert_bytes(v, units, self._all_to_all_buffers()))

    def _collectives(self, v: Variant, units: tuple[CommUnit, ...], padded: int) -> tuple[comm.Collective, ...]:
        """The layout's data-parallel collectives per step: the runtime's step schedule over its units
        (zeroshard/runtime/schedule.py), or the textbook volumes of ``padded`` elements without units."""
        spec = self.spec
        # The data-parallel mesh of the layout (stage 0 has no shards: its buffers span every rank).
        # (A variant's shards count its cp ranks too: ZeRO shards over shard x cp.)
        mesh = spec.dims.with_shard(v.shards // spec.cp if v.policy.shard_optimizer else None)
        # Data-parallel groups take every tp-th rank: a node holds gpus_per_node / tp of each.
        dp_per_node = None if self.gpus_per_node is None else max(1, self.gpus_per_node // spec.tp)
        if self.inventory is None:
            dtype = next(iter(self.master_dtypes))
            exchanges = () if self.cp_sizes is None else comm.context_rows(self.cp_sizes, mesh=mesh, accum=spec.accum,
                                                                           gpus_per_node=dp_per_node)
            return comm.textbook_collectives(
                policy=v.policy, mesh=mesh, padded=padded, compute_bytes=_size(self.compute(dtype)),
                reduce_bytes=_size(self.reduce(dtype)), accum=spec.accum, accumulation=spec.engine.accumulation,
                reshard_after_forward=spec.engine.reshard_after_forward, gpus_per_node=dp_per_node) + exchanges
        # Offload changes where the step's end finishes its reductions, not what is sent: not passed.
        options = dataclasses.replace(spec.engine, offload=OffloadPolicy())
        step = comm.step_collectives(self._unit_sizes(units), policy=v.policy, mesh=mesh, options=options, comm=self.comm,
                                     accum=spec.accum, gpus_per_node=dp_per_node, ep=spec.ep,
                                     pipeline_order=spec.pipeline_order, cp=self.cp_sizes)
        return step + self._owner_exchange(units, v)

    def _owner_exchange(self, units: tuple[CommUnit, ...], v: Variant) -> tuple[comm.Collective, ...]:
        shards = v.shards if v.policy.shard_optimizer else 1
        if self.per_tensor is None or shards == 1:
            return ()
        trainable = [g for u in units for g in u.groups if g.trainable]
        return (exchange_collective(trainable, self.per_tensor, shards, {d: d for d in self.master_dtypes}),)

    # -- expert parallelism -------------------------------------------------------------------
    def _compute_bytes(self) -> int:
        return _size(self.compute(next(iter(self.master_dtypes))))

    def _all_to_all_buffers(self, backward: bool = False) -> int:
        """One MoE layer call's all-to-all buffers on the busiest ep rank, in forward or in one
        exchange of backward (0 without ep)."""
        if not self.experts.calls():
            return 0
        size = self.experts.backward_buffer_bytes if backward else self.experts.buffer_bytes
        return size(self.spec.tokens, self._compute_bytes(), self.spec.routing_skew)

    def _ep_collectives(self) -> tuple[comm.Collective, ...]:
        if not self.experts.calls():
            return ()
        return ep_collectives(self.experts, tokens=self.spec.tokens, compute_bytes=self._compute_bytes(),
                              micro_steps=self.spec.accum, skew=self.spec.routing_skew,
                              gpus_per_node=self.gpus_per_node)

    def _expert_held(self, v: Variant, units: tuple[CommUnit, ...]) -> int:
        """The most expert bytes held in full at once during forward: every local expert at stages
        0-2, and at stage 3 the window's expert part (the units gathered at once; a group over one
        expert-data-parallel rank is gathered into a full buffer and freed like the others)."""
        compute_map = {d: self.compute(d) for d in self.master_dtypes}
        if not v.policy.shard_params:
            return sum(u.full_bytes(compute_map) for u in units)
        return self._window(units)[0]

    def _expert_bytes(self, v: Variant, units: tuple[CommUnit, ...], a2a: int) -> dict[str, int]:
        """Under ep: this rank's expert bytes by model state, the most expert bytes it holds in full
        at once in forward (``_expert_held``), one layer call's all-to-all buffers, and the element
        counts of its dense and expert params."""
        if not self.experts.calls():
            return {}
        expert = [g for u in units for g in u.groups if g.expert]
        dense = [g for u in units for g in u.groups if not g.expert]
        only = tuple(CommUnit(name=u.name, is_root=u.is_root, groups=tuple(g for g in u.groups if g.expert))
                     for u in units if any(g.expert for g in u.groups))
        states = self._runtime_states(v, only)[0]
        held = self._expert_held(v, only)
        return {**{f"expert_{k}": value for k, value in states.items()},
                "expert_held_in_forward": held, "dense_numel": sum(g.layout.param_numel for g in dense),
                "expert_numel": sum(g.layout.param_numel for g in expert), "all_to_all_buffers": a2a}

    @property
    def _bucket_bytes(self) -> int:
        return self.spec.engine.bucket_bytes

    # -- runtime accounting -------------------------------------------------------------------
    def _runtime_states(self, v: Variant, units: tuple[CommUnit, ...]
                        ) -> tuple[dict[str, int], dict[str, int], Transient]:
        """(device states, host states, transients). Offloaded (``zs.shard(offload=)``), the fp32
        masters, the optimizer state and the reduced grads the host step reads live on the host."""
        dev = {"params": 0, "grads": 0, "master": 0, "optimizer": 0}
        host = dict(dev)
        off = v.offload != "none"
        moved = host if off else dev
        groups = [g for u in units for g in u.groups]
        late_of = {id(g): 0 for g in groups}
        for g in groups:
            m, c = g.dtype, self.compute(g.dtype)
            P, S = g.numel, g.shard_numel
            if not g.trainable:  # frozen (an adapter's base): its compute-dtype values only, sharded as params
                dev["params"] += (S if v.policy.shard_params else P) * _size(c)
                continue
            # The master is the param itself when the dtypes agree, unless offload keeps it on the host.
            own = c == m and not off
            dev["params"] += (S * _size(m) if own else 0) if v.policy.shard_params else P * _size(c)
            moved["master"] += 0 if own else S * _size(m)  # stage 0: one shard = the whole buffer
            if g.trainable:
                kept, made = self._grads(v, g)
                dev["grads"] += kept
                moved["grads"] += made
                late_of[id(g)] = made
        moved["optimizer"] = self._optimizer(groups, v)
        created = [sum(late_of[id(g)] for g in u.groups) for u in units]
        late = [0] * len(units) if off else created  # device grads the reductions create
        window, start_window = self._window(units) if v.policy.shard_params else (0, 0)
        buckets, during, early, running = self._backward(units, v, late)
        # Offloaded, the reductions create host grads instead: the same moments over both memories.
        during_combined = self._backward(units, v, created)[1] if off else during
        if off:
            # No per-unit pipeline: the host step runs once every reduction has finished, in one
            # call over every segment. On a CPU run it lands in the same memory as the rest.
            scratch = [self._call_scratch(list(units), v)] if self.host_is_device else [0]
            running = []
        else:
            scratch = self._unit_scratch(units, v)
        step = max((s + sum(b for i, b in running if i > j) for j, s in enumerate(scratch)), default=0)
        # Stages 0-1 reduce on the last micro-step only; 2-3 accumulating in shards have the host
        # shard from the first micro-step on, so the last micro-step's backward starts with it.
        unsharded = self.spec.accum == 1 or self.spec.engine.accumulation == "unsharded"
        host_late = host["grads"] if off and (unsharded or not v.policy.transient_grads) else 0
        transient = Transient(buckets=buckets, during=during, early=early, window=window, start_window=start_window,
                              scratch=max(scratch, default=0), step=step, late_grads=sum(late), host_late=host_late,
                              during_combined=during_combined)
        return dev, (host if off else {}), transient

    def _grads(self, v: Variant, g) -> tuple[int, int]:
        """(grads kept from backward to the step, and the part of them its reduction creates)."""
        m, c, r = g.dtype, self.compute(g.dtype), self.reduce(g.dtype)
        P, S = g.numel, g.shard_numel
        off = v.offload != "none"
        if not v.policy.shard_optimizer:
            # The all-reduce runs on the grad buffer in place only if no cast is needed; otherwise
            # the reduced copy (in the master dtype) is a second full buffer. Offloaded, the copy
            # to the host is always a second buffer, except on a CPU run, where it is a no-op.
            same = c == r == m
            copy = 0 if same and (not off or self.host_is_device) else P * _size(m)
            return P * _size(c), copy
        if not v.policy.transient_grads:
            return P * _size(c), S * _size(m)
        unsharded = self.spec.accum > 1 and self.spec.engine.accumulation == "unsharded"
        # Accumulating in shards, the shard already holds earlier micro-steps when backward
        # starts (none of it is late); accumulating unsharded, the first reduction is the last micro-step's.
        late = S * _size(m) if self.spec.accum == 1 or unsharded or off else 0
        return S * _size(m) - late, late

    def _optimizer(self, groups, v: Variant) -> int:
        """Optimizer bytes on the worst rank (the buffer tail makes the last ranks lighter)."""
        trainable = [g for g in groups if g.trainable]
        shards = v.shards if v.policy.shard_optimizer else 1
        if self.per_tensor is not None:
            per_element = max((self.costs[g.dtype].per_element for g in trainable), default=0.0)
            return max(optimizer_per_rank(trainable, self.per_tensor, shards, per_element))
        best_rank, best = 0, -1.0
        for rank in range(shards):
            value = sum(self.costs[g.dtype].per_element * g.optimizer_numel(rank) for g in trainable)
            if value > best:
                best_rank, best = rank, value
        return sum(self.costs[g.dtype].bytes_for(g.optimizer_numel(best_rank), g.segments(best_rank))
                   for g in trainable)

    def _unit_scratch(self, units: tuple[CommUnit, ...], v: Variant) -> list[int]:
        """Per unit, the temporaries of its optimizer step on the worst rank.

        zs.optimizer steps one unit at a time, in reduction order: one call of the torch class over
        that unit's segments, one loop per torch param group (decaying or not), whose temporaries
        die with it. Consecutive units share one call until it has PIPELINE_MIN_NUMEL shard
        elements; the call runs once the last of them is reduced, so its scratch is charged at that unit.
        """
        calls, current, numel = [], [], 0
        for i, u in enumerate(units):
            current.append(i)
            numel += sum(g.shard_numel for g in u.groups if g.trainable)
            if numel >= PIPELINE_MIN_NUMEL or i == len(units) - 1:
                calls.append(current)
                current, numel = [], 0
        out = [0] * len(units)
        for call in calls:
            out[call[-1]] = self._call_scratch([units[i] for i in call], v)
        return out

    def _call_scratch(self, units: list[CommUnit], v: Variant) -> int:
        """Temporaries of one call of the torch class over ``units``' segments, on the worst rank.

        A foreach loop (torch's default on CUDA) materialises one temporary per element (the second
        moment's sqrt). The per-tensor loop (the CPU default) makes two per segment (that sqrt, then
        the denominator it is divided into) while the previous segment's denominator is still bound
        to the loop's variable. A fused kernel needs none.
        """
        trainable = [g for u in units for g in u.groups if g.trainable]
        if not trainable:
            return 0
        per_element = max(self.costs[g.dtype].per_element for g in trainable)
        if per_element == 0 or self.spec.optimizer_kwargs.get("fused"):
            return 0  # no state to take a temporary of, or a fused kernel
        elem = max(_size(g.dtype) for g in trainable)
        worst = 0
        for rank in range(v.shards if v.policy.shard_optimizer else 1):
            loops: dict[bool, list[int]] = {}
            for g in trainable:
                for decay, numel in g.segment_numels(rank):
                    loops.setdefault(decay, []).append(numel)
            for seg in loops.values():
                need = sum(seg) if self.foreach else max(p + 2 * c for p, c in zip([0] + seg, seg))
                worst = max(worst, need)
        return worst * elem

    def _unit_grads(self, units: tuple[CommUnit, ...], v: Variant, late: list[int]) -> list[_UnitGrads]:
        spec = self.spec
        compute_map = {d: self.compute(d) for d in self.master_dtypes}
        activations = self._alive_activations(units)
        root = sum(u.full_bytes(compute_map) for u in units if u.is_root)
        blocks = [u for u in units if not u.is_root]  # reduction order
        unsharded = spec.accum > 1 and spec.engine.accumulation == "unsharded"
        out = []
        for i, u in enumerate(units):
            window = 0
            if v.policy.shard_params:
                # Its grads complete before it is resharded. Its backward prefetched the next
                # ``prefetch`` units (issued once backward_prefetch_at of its grads are ready, so by
                # its last one); the root stays gathered until backward ends. Without
                # reshard_after_forward, every unit not yet through backward is still gathered.
                k = next((j for j, b in enumerate(blocks) if b is u), len(blocks))
                prefetched = spec.engine.prefetch if spec.engine.backward_prefetch_at <= 1 else 0
                ahead = blocks[k:] if not spec.engine.reshard_after_forward else blocks[k:k + 1 + prefetched]
                window = root + sum(b.full_bytes(compute_map) for b in ahead)
            per_param = flat = reduced = cast = 0
            for g in u.groups:
                if not g.trainable:
                    continue
                c, r, m = self.compute(g.dtype), self.reduce(g.dtype), g.dtype
                if v.policy.transient_grads and self.reduce_in_place and c == r and not unsharded:
                    # The per-param grads are what the reduction holds in flight: no collection.
                    flat += g.layout.param_numel * _size(c)
                    second = spec.accum > 1 or r != m
                    reduced += g.shard_numel * _size(r) if second else 0
                elif v.policy.transient_grads:
                    per_param += g.layout.param_numel * _size(c)
                    flat += g.numel * _size(r)
                    second = (spec.accum > 1 and not unsharded) or r != m
                    reduced += g.shard_numel * _size(r) if second else 0
                elif v.policy.shard_optimizer:
                    cast += g.numel * _size(r) if c != r else 0
                    reduced += g.shard_numel * _size(r) if r != m else 0
            out.append(_UnitGrads(late=late[i], activations=activations[i], window=window, per_param=per_param,
                                  flat=flat, reduced=reduced, cast=cast))
        return out

    def _alive_activations(self, units: tuple[CommUnit, ...]) -> list[int]:
        if self.act is None:
            return [0] * len(units)
        return alive_activations(self.act, [([s.fqn for g in u.groups for s in g.layout.slots], u.is_root)
                                            for u in units], self.spec.checkpointing)

    def _backward(self, units: tuple[CommUnit, ...], v: Variant,
                  late: list[int]) -> tuple[int, int, int, list[tuple[int, int]]]:
        """(buckets, during, early, running): the peak of grad memory in flight, of everything above
        the model states after backward's start, the grad memory in flight when backward starts,
        and (unit index, bytes) of the reductions still running when it ends.

        Reductions launch in the units' order, each when its unit's grads are complete, and the
        engine frees their buffers when it reaps them: as soon as they finish, but at the latest, at
        stages 2-3, when one more launches while ``max_inflight`` are pending (the oldest is waited
        on). Backward's end does not wait for the last ones: the optimizer step finishes each when it
        reaches its unit. When each finishes is timing, on gloo's worker threads as on NCCL's
        stream, so this is the bound the engine guarantees, reached when every reduction is slower
        than the next unit's backward. At each unit's last grad:

        - stages 2-3: its per-param grads are copied into a freshly allocated flat buffer, so for a
          moment both exist, next to the flat buffers of the ``max_inflight`` units before it still
          reducing; then its reduction launches (its shard appears) and the oldest is reaped;
        - stage 0: the all-reduce runs in the grad buffer (or the reduced copy, in the grads);
        - stage 1: the reduce-scatter reads the persistent grads in place (nothing in flight), or a
          reduce-dtype cast of them, which the engine does not cap: every cast can be alive at
          backward's end, and into the step.

        Each moment also holds the activations of the units not yet through backward, stage 3's
        gathered params, and the grad shards created so far.

        Accumulating unsharded (stages 2-3, accum > 1), the flat buffers are allocated in the first
        micro-step and carried to the last, whose reductions free them: every one is in flight when
        a later micro-step's backward starts, and its units' grads are added into them.
        """
        grads = self._unit_grads(units, v, late)
        compute_map = {d: self.compute(d) for d in self.master_dtypes}
        carried = v.policy.transient_grads and self.spec.accum > 1 and self.spec.engine.accumulation == "unsharded"
        early = sum(g.flat for g in grads) if carried else 0
        moments: list[tuple[int, int]] = [(early, 0)]  # (grad memory in flight, everything above the states)
        pending = sum(late)  # grads the reductions have not created yet
        ahead = early  # carried flat buffers not yet reduced
        reducing: list[tuple[int, int]] = []  # stages 2-3: (unit, bytes) launched and unreaped, oldest first
        held: list[tuple[int, int]] = []  # stages 0-1: (unit, casts), all unreaped in the bound
        for i, g in enumerate(grads):
            activations = g.activations
            if v.policy.transient_grads:
                if carried:  # an earlier micro-step: no reduction, no shard yet
                    moments.append((early + g.per_param, early + g.per_param - sum(late) + activations + g.window))
                flat = ahead if carried else g.flat
                before = sum(b for _, b in reducing)
                collect = before + flat + g.per_param
                moments.append((collect, collect - pending + activations + g.window))
                pending -= g.late
                launch = before + flat + g.reduced
                moments.append((launch, launch - pending + activations + g.window))
                ahead -= g.flat if carried else 0
                # A unit without trainable params launches nothing but still takes a place in line.
                reducing = (reducing + [(i, g.flat + g.reduced)])[-self.max_inflight:]
            else:
                pending -= g.late
                held.append((i, g.cast + g.reduced))
                inflight = sum(b for _, b in held)
                moments.append((inflight, inflight - pending + activations))
        # Backward's end: the reductions still running stay; stage 3's root is still gathered
        # (every unit is resharded as backward ends).
        running = reducing if v.policy.transient_grads else held
        end = sum(b for _, b in running)
        root = sum(u.full_bytes(compute_map) for u in units if u.is_root) if v.policy.shard_params else 0
        moments.append((end, end + root))
        return max(m[0] for m in moments), max(m[1] for m in moments), early, running

    def _window(self, units: tuple[CommUnit, ...]) -> tuple[int, int]:
        """Stage 3's all-gather window: the most full-param bytes gathered at once, and at
        backward's start, read off the runtime's step schedule (its gathers and frees, with
        prefetch, resharding and checkpoint segments as the engine runs them)."""
        spec = self.spec
        sizes = self._unit_sizes(units)
        # Over one shard the engine still allocates each unit's full buffer when it "gathers" it, but
        # issues no all-gather for the schedule to show; the window's timing does not depend on the
        # shard count, so it is read off a schedule over two.
        # (Expert groups shard over shard / ep of them: at least two as well.)
        shard = max(2 * spec.ep, spec.dp)
        mesh = ParallelDims(shard=shard, tp=spec.tp)
        schedule = step_schedule(sizes, policy=StagePolicy(3), mesh=mesh,
                                 options=dataclasses.replace(spec.engine, offload=OffloadPolicy()), accum=spec.accum,
                                 pipeline_order=spec.pipeline_order)
        return schedule.peak_gathered_bytes(sizes), schedule.gathered_at_backward_start(sizes)

    def _unit_sizes(self, units: tuple[CommUnit, ...]) -> list[UnitSizes]:
        """The units as the step schedule takes them, in this plan's compute and reduce dtypes."""
        return [UnitSizes(name=u.name, is_root=u.is_root, groups=tuple(
            GroupSizes(numel=g.numel, shard_numel=g.shard_numel, trainable=g.trainable,
                       compute_dtype=self.compute(g.dtype), reduce_dtype=self.reduce(g.dtype),
                       optimizer_numel=g.optimizer_numel(0), ep=g.ep) for g in u.groups)) for u in units]

    def _largest_param_grad(self) -> int:
        """Stages 0-3 all see autograd produce one param's grad as a fresh tensor before it is moved
        or added into the flat buffer."""
        if self.inventory is None:
            return 0
        inv = self.inventory
        refs = [r for s in inv.specs for r in s.refs if r.param.requires_grad]
        return max((inv.local_numel(r) * _size(self.compute(r.param.dtype)) for r in refs), default=0)

    # -- textbook accounting ------------------------------------------------------------------
    def _textbook(self, v: Variant) -> tuple[dict[str, int], Transient, int, int]:
        """The ZeRO paper's table: no padding, grads in the reduce dtype, optimizer cost from the probe."""
        m = torch.float32
        c, r = self.compute(m), self.reduce(m)
        psi, frozen, n = self.psi, self.frozen, v.shards
        cost: OptimStateCost = self.costs[m]
        states = {
            "params": int((psi + frozen) * _size(c) / (n if v.policy.shard_params else 1)),
            "grads": int(psi * _size(r) / (n if v.policy.transient_grads else 1)),
            "master": 0 if c == m else int(psi * _size(m) / (n if v.policy.shard_optimizer else 1)),
            "optimizer": int(cost.per_element * psi / (n if v.policy.shard_optimizer else 1)),
        }
        # Without units only the bucket size is known: two buckets in flight at stage 2.
        buckets = 2 * min(self._bucket_bytes, psi * _size(r)) if v.stage == 2 else 0
        foreach = cost.per_element and self.foreach and not self.spec.optimizer_kwargs.get("fused")
        scratch = int(states["optimizer"] / cost.per_element * _size(m)) if foreach else 0
        return states, Transient(buckets=buckets, early=buckets, during=buckets, scratch=scratch, step=scratch), \
            psi + frozen, 0
