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

from zeroshard.runtime.offload.policy import OffloadPolicy
from zeroshard.tools.planner import comm
from zeroshard.tools.planner.backward_memory import BackwardMemory
from zeroshard.tools.planner.estimate_base import Transient, element_bytes
from zeroshard.tools.planner.experts import ep_collectives
from zeroshard.tools.planner.inventory import CommUnit
from zeroshard.tools.planner.optimizer_memory import OptimizerMemory
from zeroshard.tools.planner.owner_state import exchange_collective
from zeroshard.tools.planner.result import Components, LayoutPlan
from zeroshard.tools.planner.textbook import TextbookMemory, textbook_offload
from zeroshard.tools.planner.variants import Variant
# The engine's constants, imported: one value, not two copies.
from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.clip import SQUARE_CHUNK
from zeroshard.runtime.schedule import step_schedule
from zeroshard.comm.dims import ParallelDims
from zeroshard.runtime.schedule_events import GroupSizes, UnitSizes

__all__ = ["Estimator"]


class Estimator(BackwardMemory, OptimizerMemory, TextbookMemory):
    """Plans every layout of one spec, for a model inventory or a bare parameter count: model states by
    the runtime's layout (here), backward's transients (backward_memory.py), the optimizer's state and
    scratch (optimizer_memory.py), or the textbook table without an inventory (textbook.py)."""

    # -- one layout ---------------------------------------------------------------------------
    def layout(self, v: Variant) -> LayoutPlan:
        units: tuple[CommUnit, ...] = ()
        if self.inventory is None:
            states, t, padded, _ = self._textbook(v)
            states, host = textbook_offload(states, v)
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
        # A block's temporaries come after the head's backward, which has freed what the head saved.
        start = (self.act.saved + max(self.act.head, self.act.recompute + self.act.block + a2a - self.act.head_saved)
                 if self.act else a2a) + largest_grad
        # Each component is reported at its own peak; the step's peak is the largest of three moments:
        # backward's start (every saved activation, the window, backward temporaries, but not yet
        # the grads the reductions create), backward's worst later moment (``Transient.during``: at
        # stages 2-3 a unit's grads being collected into their flat buffer while the units before
        # it still reduce, next to the activations, gathered params and grad shards of that moment;
        # at stages 0-1 backward's end, every grad and cast copy there; see ``_backward``), and
        # optimizer.step (a unit's scratch, next to the reductions still running; ``_step``). What
        # the components over-count together is the overlap.
        states_total = sum(states.values())
        # Clipping's global grad norm: a float64 copy of one grad chunk at a time (a run that does not
        # clip makes none: the non-finite guard reads fp32 buffer norms instead).
        norm = 8 * min(SQUARE_CHUNK, max((g.shard_numel if v.policy.shard_optimizer else g.numel for u in units
                                          for g in u.groups if g.trainable), default=0)) \
            if self.inventory and self.spec.clip > 0 else 0
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
                policy=v.policy, mesh=mesh, padded=padded, compute_bytes=element_bytes(self.compute(dtype)),
                reduce_bytes=element_bytes(self.reduce(dtype)), accum=spec.accum, accumulation=spec.engine.accumulation,
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
                dev["params"] += (S if v.policy.shard_params else P) * element_bytes(c)
                continue
            # The master is the param itself when the dtypes agree, unless offload keeps it on the host.
            own = c == m and not off
            dev["params"] += (S * element_bytes(m) if own else 0) if v.policy.shard_params else P * element_bytes(c)
            moved["master"] += 0 if own else S * element_bytes(m)  # stage 0: one shard = the whole buffer
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
            copy = 0 if same and (not off or self.host_is_device) else P * element_bytes(m)
            return P * element_bytes(c), copy
        if not v.policy.transient_grads:
            return P * element_bytes(c), S * element_bytes(m)
        unsharded = self.spec.accum > 1 and self.spec.engine.accumulation == "unsharded"
        # Accumulating in shards, the shard already holds earlier micro-steps when backward
        # starts (none of it is late); accumulating unsharded, the first reduction is the last micro-step's.
        late = S * element_bytes(m) if self.spec.accum == 1 or unsharded or off else 0
        return S * element_bytes(m) - late, late

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
        return max((inv.local_numel(r) * element_bytes(self.compute(r.param.dtype)) for r in refs), default=0)
