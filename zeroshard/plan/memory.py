"""The estimator: per-rank bytes by component, for every stage side by side.

Two accountings:

- ``runtime`` (models): what *this* runtime allocates, group by group, from the same layout code
  ``zs.shard`` runs (docs/runtime.md, "Memory contract per rank"). Padding, frozen params, tied
  weights, the separate fp32 reduced-grad shard from stage 1, and masters that alias fp32 params
  are all as the runtime does them.
- ``textbook`` (a bare parameter count): the seeds' table, 2Ψ + 2Ψ + 12Ψ split per stage, with the
  optimizer's bytes still discovered by running it (MISSION M1, M3).

docs/planner.md gives the formulas.
"""

from __future__ import annotations

import dataclasses

import torch

from zeroshard.plan import comm
from zeroshard.plan.activations import ActivationEstimate
from zeroshard.plan.inventory import CommUnit, Inventory
from zeroshard.plan.optim_probe import OptimStateCost, probe
from zeroshard.plan.result import Components, LayoutPlan
from zeroshard.plan.spec import STAGE_NAMES, PlanSpec


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype, device="meta").element_size()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Transient:
    """Memory that comes and goes within a step, and when it is there."""

    buckets: int = 0
    """Peak of full grad buffers in flight."""
    early: int = 0
    """Grad buffers already live when backward starts (next to every saved activation)."""
    collective: int = 0
    """gloo only: the bucket-sized temporary a reduce-scatter holds while it runs (end of backward)."""
    window: int = 0
    late_window: int = 0
    """Gathered params still live when backward ends (stage 3: the root)."""
    scratch: int = 0
    """Optimizer step temporaries."""
    late_grads: int = 0
    """Part of the grads that the reductions create during backward (reduced copies and shards),
    so it is not there yet when backward starts."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
    """One layout to plan: a stage, how many ranks shard each buffer, and what is offloaded."""

    name: str
    stage: int
    shards: int
    offload: str = "none"


def variants(spec: PlanSpec) -> list[Variant]:
    """DDP and ZeRO-1/2/3 over the whole world, plus hybrid and offload variants when asked."""
    out = [Variant(name=STAGE_NAMES[s], stage=s, shards=1 if s == 0 else spec.world) for s in range(4)]
    if spec.hybrid:
        out += [Variant(name=f"{STAGE_NAMES[s]}_hybrid", stage=s, shards=spec.shard_size) for s in (1, 2, 3)]
    if spec.offload == "optimizer":
        out += [Variant(name=f"{STAGE_NAMES[s]}_offload", stage=s, shards=spec.world, offload="optimizer")
                for s in (1, 2, 3)]
    elif spec.offload == "params":
        out.append(Variant(name="zero3_offload", stage=3, shards=spec.world, offload="params"))
    return out


def _offload(states: dict[str, int], offload: str, stage: int, sharded_grads: int) -> tuple[dict[str, int], int]:
    """Move what offload moves to the host. Optimizer offload takes the master, the optimizer state
    and the fp32 grad shard the host step reads; params offload (stage 3) also takes the param shard."""
    if offload == "none":
        return states, 0
    moved = {"master": states["master"], "optimizer": states["optimizer"], "grads": sharded_grads}
    if offload == "params" and stage == 3:
        moved["params"] = states["params"]
    out = {k: v - moved.get(k, 0) for k, v in states.items()}
    return out, sum(moved.values())


class Estimator:
    """Plans every layout of one spec, for a model inventory or a bare parameter count."""

    def __init__(self, spec: PlanSpec, *, inventory: Inventory | None = None, psi: int = 0, frozen: int = 0,
                 activations: ActivationEstimate | None = None, foreach: bool = True,
                 gpus_per_node: int | None = None, reap_at_end: bool = False) -> None:
        self.spec = spec
        self.reap_at_end = reap_at_end
        self.gpus_per_node = gpus_per_node
        self.inventory = inventory
        self.psi, self.frozen = psi, frozen
        self.act = activations
        self.foreach = foreach
        self.master_dtypes = inventory.dtypes if inventory else {torch.float32}
        self.costs = {d: probe(spec.optimizer, d, spec.optimizer_kwargs) for d in sorted(self.master_dtypes, key=str)}

    def compute(self, dtype: torch.dtype) -> torch.dtype:
        return self.spec.mp.compute_dtype(dtype)

    def reduce(self, dtype: torch.dtype) -> torch.dtype:
        return self.spec.mp.reduction_dtype(dtype)

    # -- one layout ---------------------------------------------------------------------------
    def layout(self, v: Variant) -> LayoutPlan:
        if self.inventory is None:
            states, t, padded, root_padded = self._textbook(v)
        else:
            units = self.inventory.comm_units(stage=v.stage, shards=v.shards, bucket_bytes=self._bucket_bytes)
            states, t = self._runtime_states(v, units)
            padded = sum(g.numel for u in units for g in u.groups)
            root_padded = sum(g.numel for u in units if u.is_root for g in u.groups)
        sharded_grads = states["grads"] if v.stage >= 2 else self._grad_shard_bytes(v)
        states, host = _offload(states, v.offload, v.stage, sharded_grads)
        if v.offload != "none":
            t = dataclasses.replace(t, scratch=0)  # the optimizer step runs on the host, scratch too
        activations = self.act.total if self.act else 0
        backward_ws = (self.act.workspace if self.act else 0) + self._largest_param_grad()
        # Each component is reported at its own peak; the step's peak is the largest of three moments:
        # backward's start (every saved activation, the window, the first grad buffers, backward
        # temporaries, but not yet the grads the reductions create), backward's end (every grad,
        # the buffers still in flight, on gloo the reduce-scatter's own copy), and optimizer.step
        # (its scratch). What the components over-count together is the overlap.
        states_total = sum(states.values())
        phases = (states_total - t.late_grads + activations + t.window + t.early + backward_ws,
                  states_total + t.buckets + t.collective + t.late_window,
                  states_total + t.scratch)
        workspace = max(backward_ws, t.scratch, t.collective)
        allocated = max(phases)
        overlap = states_total + activations + t.window + t.buckets + workspace - allocated
        device = Components(**states, activations=activations, window=t.window, buckets=t.buckets,
                            workspace=workspace, headroom=int(round(self.spec.headroom * allocated)), overlap=overlap)
        dtype = next(iter(self.master_dtypes))
        collectives = comm.step_collectives(
            stage=v.stage, world=self.spec.world, shards=v.shards, padded=padded, root_padded=root_padded,
            compute_bytes=_size(self.compute(dtype)), reduce_bytes=_size(self.reduce(dtype)), accum=self.spec.accum,
            accumulation=self.spec.accumulation, reshard_after_forward=self.spec.reshard_after_forward,
            gpus_per_node=self.gpus_per_node)
        planned = tuple(x for x, on in (("offload", v.offload != "none"),
                                        ("checkpointing", self.spec.checkpointing.policy != "none")) if on)
        return LayoutPlan(name=v.name, stage=v.stage, shard_size=v.shards, replicas=self.spec.world // v.shards,
                          offload=v.offload, checkpointing=str(self.spec.checkpointing), device=device,
                          host_bytes=host, collectives=collectives, planned_only=planned)

    @property
    def _bucket_bytes(self) -> int:
        return int(self.spec.bucket_mb * 2**20)  # as zs.shard converts bucket_mb

    # -- runtime accounting -------------------------------------------------------------------
    def _runtime_states(self, v: Variant, units: tuple[CommUnit, ...]) -> tuple[dict[str, int], Transient]:
        spec = self.spec
        params = grads = master = late = 0
        groups = [g for u in units for g in u.groups]
        for g in groups:
            m, c, r = g.dtype, self.compute(g.dtype), self.reduce(g.dtype)
            P, S = g.numel, g.shard_numel
            aliased = c == m
            if v.stage < 3:
                params += P * _size(c)
                master += 0 if aliased else S * _size(m)  # stage 0: one shard = the whole buffer
            else:
                params += S * _size(m) if aliased else 0  # the fp32 shard *is* the param between uses
                master += 0 if aliased else S * _size(m)
            if not g.trainable:
                continue
            if v.stage == 0:
                # The all-reduce runs on the grad buffer in place only if no cast is needed; otherwise
                # the reduced copy (in the master dtype) is a second full buffer.
                copy = 0 if c == r == m else P * _size(m)
                grads += P * _size(c) + copy
                late += copy
            elif v.stage == 1:
                grads += P * _size(c) + S * _size(m)
                late += S * _size(m)
            else:
                grads += S * _size(m)
                # With accumulation the shard already holds earlier micro-steps when backward starts.
                late += S * _size(m) if spec.accum == 1 else 0
                if spec.accum > 1 and spec.accumulation == "unsharded":
                    grads += P * _size(r)  # full grads carried across micro-steps
        optimizer, largest_segment = self._optimizer(groups, v)
        buckets, early = self._buckets(units, v)
        reduce_map = {d: self.reduce(d) for d in self.master_dtypes}
        compute_map = {d: self.compute(d) for d in self.master_dtypes}
        # Measured: gloo's reduce-scatter holds a temporary the size of its input while it runs, and
        # the runtime waits on them when backward ends.
        collective = max(u.grad_bytes(reduce_map) for u in units) if self.reap_at_end and v.stage >= 1 else 0
        window = self._window(units) if v.stage == 3 else 0
        late_window = sum(u.full_bytes(compute_map) for u in units if u.is_root) if v.stage == 3 else 0
        if v.stage == 3 and not spec.reshard_after_forward:
            late_window = window
        transient = Transient(buckets=buckets, early=early, collective=collective, window=window,
                              late_window=late_window, scratch=self._scratch(optimizer, largest_segment, groups),
                              late_grads=late)
        return {"params": params, "grads": grads, "master": master, "optimizer": optimizer}, transient

    def _optimizer(self, groups, v: Variant) -> tuple[int, int]:
        """Optimizer bytes on the worst rank (the buffer tail makes the last ranks lighter)."""
        trainable = [g for g in groups if g.trainable]
        shards = v.shards if v.stage >= 1 else 1
        best_rank, best = 0, -1.0
        for rank in range(shards):
            value = sum(self.costs[g.dtype].per_element * g.optimizer_numel(rank) for g in trainable)
            if value > best:
                best_rank, best = rank, value
        total = sum(self.costs[g.dtype].bytes_for(g.optimizer_numel(best_rank), g.segments(best_rank))
                    for g in trainable)
        largest = max((g.optimizer_numel(best_rank) for g in trainable), default=0)
        largest_slot = max((s.span for g in trainable for s in g.layout.slots), default=0)
        return total, min(largest, largest_slot)

    def _scratch(self, optimizer_bytes: int, largest_segment: int, groups) -> int:
        # A foreach step (torch's default on CUDA) materialises one temporary per state element
        # (sqrt of the second moment); the per-tensor loop (CPU default) holds two temporaries of
        # the largest segment at a time.
        per_element = max(self.costs[g.dtype].per_element for g in groups if g.trainable)
        if per_element == 0 or self.spec.optimizer_kwargs.get("fused"):
            return 0  # no state to take a temporary of, or a fused kernel that needs none
        elem = max(_size(g.dtype) for g in groups if g.trainable)
        if self.foreach:
            return int(optimizer_bytes / per_element * elem)
        return 2 * largest_segment * elem

    def _buckets(self, units: tuple[CommUnit, ...], v: Variant) -> tuple[int, int]:
        """(peak, live at backward's start) bytes of full grad buffers in flight."""
        reduce_map = {d: self.reduce(d) for d in self.master_dtypes}
        compute_map = {d: self.compute(d) for d in self.master_dtypes}
        if v.stage == 0:
            return 0, 0
        if v.stage == 1:
            # Reduce-scatter input: a reduce-dtype copy of each bucket when the grads are in another
            # dtype, made as the bucket launches (so none yet when backward starts), kept until reaped.
            casts = [u.grad_bytes(reduce_map) for u in units if any(compute_map[g.dtype] != reduce_map[g.dtype]
                                                                   for g in u.groups)]
            return (sum(casts) if self.reap_at_end else 2 * max(casts, default=0)), 0
        if self.spec.accum > 1 and self.spec.accumulation == "unsharded":
            return 0, 0  # the full grad buffers are already counted in grads
        # Stages 2-3 allocate a unit's full grad buffer at its first grad and free it when its
        # reduce-scatter is reaped. The head's grads arrive first, so the root's buffer lives through
        # the whole backward. With NCCL the others come and go: one filling while the previous one's
        # reduce-scatter finishes. gloo's async reduce-scatter reports completion only once waited
        # on, so on CPU the runtime waits on the oldest once more than max_inflight_reductions (1)
        # is pending: one launched plus the one filling, as with NCCL.
        # With accumulation the shard already exists, so each reduce-scatter's output is a second
        # shard-sized buffer until it has been added in.
        extra = self.spec.accum > 1

        def cost(u: CommUnit) -> int:
            return u.grad_bytes(reduce_map) + (u.shard_grad_bytes(reduce_map) if extra else 0)

        root = sum(cost(u) for u in units if u.is_root)
        in_order = [cost(u) for u in units if not u.is_root]  # reduction order
        if self.reap_at_end:
            return root + sum(sorted(in_order, reverse=True)[:2]), root + (in_order[0] if in_order else 0)
        top = root + sum(sorted(in_order, reverse=True)[:2])
        return top, top

    def _window(self, units: tuple[CommUnit, ...]) -> int:
        compute_map = {d: self.compute(d) for d in self.master_dtypes}
        root = sum(u.full_bytes(compute_map) for u in units if u.is_root)
        blocks = [u.full_bytes(compute_map) for u in reversed(units) if not u.is_root]  # forward order
        if not self.spec.reshard_after_forward:
            return root + sum(blocks)
        live = 1 + self.spec.prefetch
        return root + max((sum(blocks[i:i + live]) for i in range(len(blocks))), default=0)

    def _grad_shard_bytes(self, v: Variant) -> int:
        """Stage 1's fp32 reduced-grad shard: what optimizer offload would move besides the states."""
        if v.stage != 1 or self.inventory is None:
            return 0
        units = self.inventory.comm_units(stage=1, shards=v.shards, bucket_bytes=self._bucket_bytes)
        return sum(g.shard_numel * _size(g.dtype) for u in units for g in u.groups if g.trainable)

    def _largest_param_grad(self) -> int:
        """Stages 0-3 all see autograd produce one param's grad as a fresh tensor before it is moved
        or added into the flat buffer."""
        if self.inventory is None:
            return 0
        refs = [r for s in self.inventory.specs for r in s.refs if r.param.requires_grad]
        return max((r.param.numel() * _size(self.compute(r.param.dtype)) for r in refs), default=0)

    # -- textbook accounting ------------------------------------------------------------------
    def _textbook(self, v: Variant) -> tuple[dict[str, int], Transient, int, int]:
        """The seeds' table: no padding, grads in the reduce dtype, optimizer cost from the probe."""
        m = torch.float32
        c, r = self.compute(m), self.reduce(m)
        psi, frozen, n = self.psi, self.frozen, v.shards
        cost: OptimStateCost = self.costs[m]
        states = {
            "params": int((psi + frozen) * _size(c) / (n if v.stage == 3 else 1)),
            "grads": int(psi * _size(r) / (n if v.stage >= 2 else 1)),
            "master": 0 if c == m else int(psi * _size(m) / (n if v.stage >= 1 else 1)),
            "optimizer": int(cost.per_element * psi / (n if v.stage >= 1 else 1)),
        }
        # Without units only the bucket size is known: two buckets in flight at stage 2.
        buckets = 2 * min(self._bucket_bytes, psi * _size(r)) if v.stage == 2 else 0
        foreach = cost.per_element and self.foreach and not self.spec.optimizer_kwargs.get("fused")
        scratch = int(states["optimizer"] / cost.per_element * _size(m)) if foreach else 0
        return states, Transient(buckets=buckets, early=buckets, scratch=scratch), psi + frozen, 0
