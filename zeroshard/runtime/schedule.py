"""One optimizer step of the engine, as data: every collective and every full-param free, in order.

``step_schedule`` is a pure function. From the stage (``StagePolicy``), the engine's knobs
(``EngineOptions``), the quantized-comm switches (``CommQuant``), the layout (``ParallelDims``)
and the communication units' sizes (``UnitSizes``: names, padded and shard element counts,
dtypes) it derives the ordered ``Event`` list the engine issues in one step, without a process
group or a tensor. Each collective event carries what the ledger records for it
(zeroshard/comm/ledger.py ``CollectiveRecord``: op, group, unit, phase, numel, dtype, bytes), so
the two compare op by op (tests/distributed/test_schedule.py); ``free`` events are the engine's
``EventKind.FREE`` (zeroshard/runtime/events.py). ``compute`` and ``wait`` marks, which no ledger
records, say where each unit's passes run and where the engine blocks on a gather or a reduction,
so the list is the step's critical path too. ``engine_schedule`` builds one for a live sharded
model from its engine.

Tools that model the step aggregate this list instead of restating the stage rules: the planner's
collectives (zeroshard/tools/planner/comm.py) and its gather window, and the step-time simulator, which
prices it event by event (zeroshard/tools/sim/replay.py). Its vocabulary (the sizes, ``Event``, ``Schedule``) is
zeroshard/runtime/schedule_events.py. The order the engine follows, and so this module
(docs/runtime.md, "The step schedule"):

- each micro-step's forward first finishes the reductions the previous backward left running
  (with a replicate group, each finish all-reduces the reduced shard across replicas);
- stage 3 forward: the root, then each block in forward order, gathered on entry, with the next
  ``prefetch`` units gathered after it once the order is recorded (from the first step's first
  forward on); a block is freed after its forward unless ``reshard_after_forward`` is off or it
  is the last block of forward (``Engine.kept_for_backward``); the root stays gathered. A
  checkpoint segment longer than one unit runs inside its first unit's call, so its later units
  are entered and left before the first one is left;
- backward, in reverse forward order: stage 3 gathers a unit that is not gathered, then
  prefetches the ``prefetch`` units before it in forward order (at once with checkpointing,
  otherwise once some of its grads are in: before its own reduction either way); a segment's
  recompute gathers, phase "recompute", any of its units still sharded. A unit whose grads are
  complete is freed (stage 3, not the root) and its reduction launched, strictly in the engine's
  reduction order; at stages 2-3 the oldest is finished while more than
  ``max_inflight_reductions`` are pending. Inside ``no_sync`` stages 0-1, and 2-3 accumulating
  "unsharded", only collect their grads. Backward's end frees every unit still gathered;
- the optimizer step: clipping (when asked) finishes every reduction and all-reduces the squared
  norm; without offload the optimizer then steps unit by unit in reduction order (consecutive
  units merged until ``PIPELINE_MIN_NUMEL`` shard elements), finishing each unit's reduction
  before its step and, at stages 1-2, all-gathering its updated params after it; with offload it
  finishes them all, then gathers every group.

Which reductions finish inside backward on a mesh without replicas depends on timing (the engine
reaps the ones the backend reports done), but finishing then issues no collective, so the
sequence of collectives does not. Tensor parallelism's per-block all-reduces (DTensor's, sized by
the caller: ``TensorParallelSizes``) come in their own order, at stage 3 also in place among the
gathers and reductions; context parallelism's attention exchanges (sized by the caller:
``ContextParallelSizes``) come with each block's forward and backward. What is not modelled:
sequence parallelism, the fp16 grad scaler's overflow all-reduce, the non-finite guard's own
collectives (runtime/guard.py, phase "guard"), the step's own token-count all-reduce
(zeroshard/trainer/step.py, phase "metrics"), units that run on some ranks only, and a forward order
that differs from the module order under checkpointing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from zeroshard.comm.dims import ParallelDims
from zeroshard.comm.quant import SCALE_DTYPE, WIRE_DTYPE, CommQuant, num_blocks
from zeroshard.runtime.flat import QUANTIZED_PHASES, StagePolicy
from zeroshard.runtime.optim import PIPELINE_MIN_NUMEL
from zeroshard.runtime.options import EngineOptions
from zeroshard.runtime.recompute import segment_bounds
from zeroshard.runtime.schedule_events import (BACKWARD, CLIP, COMPUTE, EXPERTS, FORWARD, FREE, OPTIMIZER, PARAM_SYNC,
                                                RECOMPUTE, WAIT, ContextParallelSizes, Event, GroupSizes,
                                                Schedule, TensorParallelSizes, UnitSizes, dtype_name)

if TYPE_CHECKING:
    from zeroshard.runtime.engine import Engine

def step_schedule(units: Sequence[UnitSizes], *, policy: StagePolicy, mesh: ParallelDims,
                  options: EngineOptions | None = None, comm: CommQuant | None = None, accum: int = 1,
                  first_step: bool = False, forward_order: Sequence[str] | None = None,
                  clip: bool = False, tp: TensorParallelSizes | None = None,
                  pipeline_order: Sequence[tuple[str, int]] | None = None,
                  cp: ContextParallelSizes | None = None) -> Schedule:
    """The events of one optimizer step of ``accum`` micro-steps (all but the last inside
    ``zs.no_sync``), in the order the engine issues them.

    ``units`` are the engine's communication units in its reduction order (``Engine.units``:
    blocks in reverse module order, then the root; at stages 0-2 the buckets). ``forward_order``
    names the units in the order forward runs them (default: the root, then the blocks in module
    order); only stage 3 reads it. ``first_step``: the step that records the forward order, whose
    first forward prefetches nothing and keeps no block gathered into backward; otherwise the
    steady state. ``clip``: the step clips the grad norm (``zs.clip_grad_norm_``). ``tp``: the
    blocks' tensor-parallel all-reduces, when the model is split over the mesh's tp dim.

    ``pipeline_order``: the engine is one pipeline stage's (zeroshard/parallel/pipeline/runtime.py), and the
    step is its microbatches' forwards ("F", microbatch) and backwards ("B", microbatch) in the
    order torch's schedule runs them on its rank (zeroshard/parallel/pipeline/order.py), every one inside
    ``no_sync`` (``accum`` is then not read: the options' accumulation says what a backward
    reduces); the grads still unreduced are reduced once after the last (``Pipeline.reduce``). A
    forward between two backwards (1F1B's steady state) finds the units the earlier forward kept
    gathered still gathered, which the micro-step order never does. A zero-bubble schedule's input
    and weight halves ("I", "W") are the stage's split backward; ``stage_order`` gives the first
    stage's as the one whole backward torch runs for it.
    """
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        raise ValueError(f"accum must be a positive int (micro-steps per optimizer step), got {accum!r}")
    if tp is not None and mesh.tp == 1:
        raise ValueError("tp sizes were given for a mesh without a tp dim (ParallelDims.tp == 1)")
    if cp is not None and mesh.cp == 1:
        raise ValueError("cp sizes were given for a mesh without a cp dim (ParallelDims.cp == 1)")
    replay = _Replay(list(units), policy=policy, mesh=mesh, options=options or EngineOptions(),
                     comm=comm or CommQuant(), forward_order=forward_order, tp=tp, cp=cp)
    if pipeline_order is not None:
        replay.pipeline(pipeline_order, first_step=first_step)
    else:
        for micro in range(accum):
            replay.micro_step(micro, sync=micro == accum - 1, recorded=not (first_step and micro == 0))
    replay.optimizer_step(clip=clip)
    return Schedule(tuple(replay.events))


class _Replay:
    """The engine's step as a walk over unit sizes: the same states and pointers, no tensors."""

    def __init__(self, units: list[UnitSizes], *, policy: StagePolicy, mesh: ParallelDims, options: EngineOptions,
                 comm: CommQuant, forward_order: Sequence[str] | None,
                 tp: TensorParallelSizes | None = None, cp: ContextParallelSizes | None = None) -> None:
        self.units, self.policy, self.mesh, self.options, self.comm = units, policy, mesh, options, comm
        self.tp, self.cp = tp, cp
        self.shards = mesh.zero_shard if policy.shard_optimizer else 1  # shard x cp
        self.events: list[Event] = []
        self.micro = 0
        self.action = ""  # a pipeline stage's current action (pipeline)
        self.gathered: dict[str, str] = {}  # stage 3: units whose full params exist -> phase of that gather
        self.launched = 0  # into units (the reduction order): the next one to launch
        self.pending: list[tuple[UnitSizes, int]] = []  # launched, not finished: (unit, micro-step)
        self.ready: set[str] = set()
        roots = [u for u in units if u.is_root]
        self.root = roots[0] if roots else None
        if policy.shard_params:
            by_name = {u.name: u for u in units}
            if forward_order:
                missing = set(forward_order) - set(by_name)
                if missing:
                    raise ValueError(f"forward_order names units that are not in units: {sorted(missing)}")
                self.forward = [by_name[n] for n in forward_order]
            else:
                self.forward = roots + [u for u in reversed(units) if not u.is_root]
        else:
            self.forward = []
        self.index = {u.name: i for i, u in enumerate(self.forward)}
        # Checkpoint segments over the blocks in module order (the engine's Recompute), as unit runs.
        blocks = [u for u in reversed(units) if not u.is_root]
        self.segments = [blocks[a:b] for a, b in segment_bounds(options.checkpointing, len(blocks))] \
            if policy.shard_params else []
        self.recomputes = bool(segment_bounds(options.checkpointing, len(blocks)))
        if tp is not None and policy.shard_params and tp.blocks != len(blocks):
            raise ValueError(f"tp sizes name {tp.blocks} blocks but the units hold {len(blocks)}")
        counted = [u.blocks for u in units if u.blocks is not None]
        if tp is not None and not policy.shard_params and len(counted) == len(units) and sum(counted) != tp.blocks:
            raise ValueError(f"tp sizes name {tp.blocks} blocks but the buckets hold {sum(counted)}")

    # -- emitting -----------------------------------------------------------------------------
    def _emit(self, op: str, group: str, unit: str, phase: str, numel: int, dtype: torch.dtype,
              micro: int | None = None, quantized: bool = False, g: GroupSizes | None = None) -> None:
        self.events.append(Event(op=op, group=group, unit=unit, phase=phase, numel=numel, dtype=dtype_name(dtype),
                                 bytes=numel * dtype.itemsize, micro=self.micro if micro is None else micro,
                                 quantized=quantized, mesh=EXPERTS if g is not None and g.ep > 1 else "",
                                 action=self.action))

    def mark(self, op: str, unit: str, phase: str, share: float = 1.0, micro: int | None = None) -> None:
        self.events.append(Event(op=op, group="", unit=unit, phase=phase, numel=0, dtype="", bytes=0,
                                 micro=self.micro if micro is None else micro, share=share, action=self.action))

    def compute(self, unit: str, phase: str, share: float = 1.0) -> None:
        self.mark(COMPUTE, unit, phase, share)

    def _shards(self, g: GroupSizes) -> int:
        """Ranks ``g``'s buffer is sharded over: the mesh's shard dim, or an expert group's
        expert-data-parallel ranks, ``world / ep`` (ep borrows its ranks from dp x tp:
        zeroshard/comm/expert_mesh.py)."""
        if g.ep == 1 or not self.policy.shard_optimizer:
            return self.shards
        return self.mesh.stage_world // g.ep

    def _quantized_pair(self, op: str, unit: str, phase: str, g: GroupSizes, micro: int | None = None) -> None:
        """qwZ / qgZ on the wire: int8 values padded to whole blocks, then one fp32 scale per block."""
        blocks, shards = num_blocks(g.shard_numel, self.comm.block_size), self._shards(g)
        self._emit(op, "shard", unit, phase, shards * blocks * self.comm.block_size, WIRE_DTYPE, micro, True, g)
        self._emit(op, "shard", unit, phase, shards * blocks, SCALE_DTYPE, micro, True, g)

    # -- params (stage 3, and the stage 1-2 sync) -----------------------------------------------
    def tensor_parallel(self, phase: str, count: int) -> None:
        """``count`` of the blocks' tp all-reduces (DTensor's, recorded without a unit)."""
        if self.tp is not None:
            for _ in range(count):
                self._emit("all_reduce", "tp", "", phase, self.tp.numel, self.tp.dtype)

    def context_parallel(self, *phases: str) -> None:
        """One block's attention exchanges over the cp group in ``phases`` (the attention's own,
        recorded under its unit)."""
        for phase in phases if self.cp is not None else ():
            for x in (x for x in self.cp.exchanges if x.phase == phase):  # type: ignore[union-attr]
                for _ in range(x.count):
                    self._emit(x.op, "cp", self.cp.unit, phase, x.numel, self.cp.dtype)  # type: ignore[union-attr]

    def block_backward_tp(self, segment_len: int | None) -> None:
        """A block's backward all-reduces, after its checkpoint segment's rebuild when it is the
        segment's last block: the rebuild runs the segment's forward ones again but the last, which
        torch's non-reentrant checkpoint never recomputes (nothing saves that output). Its
        attention's cp exchanges (recompute, then backward) come first."""
        self.context_parallel(RECOMPUTE, BACKWARD)
        if self.tp is None:
            return
        if segment_len is not None:
            self.tensor_parallel(BACKWARD, self.tp.per_block * segment_len - 1)
        self.tensor_parallel(BACKWARD, self.tp.per_block)

    def gather(self, unit: UnitSizes, phase: str) -> None:
        """``Unit.unshard``: a no-op while the unit is gathered."""
        if unit.name in self.gathered:
            return
        for g in unit.groups:
            self._gather_group(unit, g, phase)
        self.gathered[unit.name] = phase

    def _gather_group(self, unit: UnitSizes, g: GroupSizes, phase: str) -> None:
        if self._shards(g) == 1:
            return  # nothing to gather (FlatGroup.gather_full)
        if self.policy.shard_params and self.comm.quantizes(g.numel, unit.is_root) and phase in QUANTIZED_PHASES:
            self._quantized_pair("all_gather", unit.name, phase, g)
        else:
            self._emit("all_gather", "shard", unit.name, phase, g.numel, g.compute_dtype, g=g)

    def gather_and_wait(self, unit: UnitSizes, phase: str) -> None:
        """``Unit.unshard`` then ``Unit.wait_unshard``: the unit's compute needs its params now
        (the wait is on the prefetch when one is in flight)."""
        self.gather(unit, phase)
        self.mark(WAIT, unit.name, phase)

    def reshard(self, unit: UnitSizes) -> None:
        """``Unit.reshard``: a no-op while sharded."""
        phase = self.gathered.pop(unit.name, None)
        if phase is not None:
            self.events.append(Event(op=FREE, group="", unit=unit.name, phase=phase, numel=unit.full_numel,
                                     dtype=_common_dtype(g.compute_dtype for g in unit.groups),
                                     bytes=unit.full_bytes, micro=self.micro, action=self.action))

    # -- grads --------------------------------------------------------------------------------
    def _grads_quantized(self, g: GroupSizes) -> bool:
        return self.policy.transient_grads and g.trainable and self.comm.quantizes_grads(g.numel) and self._shards(g) > 1

    def launch(self, unit: UnitSizes) -> None:
        """``Unit.launch_reduce``: each trainable group's reduction (none for a frozen unit)."""
        for g in unit.groups:
            if not g.trainable:
                continue
            if self._grads_quantized(g):
                self._quantized_pair("all_to_all", unit.name, BACKWARD, g)
            elif not self.policy.shard_optimizer:
                # An expert group's identical copies are its expert-data-parallel ranks (ExpertMesh.dp_name).
                group = "dp" if g.ep > 1 else self.mesh.dp_group
                self._emit("all_reduce", group, unit.name, BACKWARD, g.numel, g.reduce_dtype, g=g)
            else:
                self._emit("reduce_scatter", "shard", unit.name, BACKWARD, g.numel, g.reduce_dtype, g=g)
        self.pending.append((unit, self.micro))

    def finish(self, unit: UnitSizes, micro: int) -> None:
        """``Unit.finish_reduce``: waits for the reduction; with replicas, the reduced shard is then
        all-reduced across them, a blocking call."""
        self.mark(WAIT, unit.name, BACKWARD, micro=micro)
        if not (self.policy.shard_optimizer and self.mesh.replicate > 1):
            return
        for g in unit.groups:
            if g.trainable and g.ep == 1:  # the expert mesh has no replicas
                dtype = SCALE_DTYPE if self._grads_quantized(g) else g.reduce_dtype
                self._emit("all_reduce", "replicate", unit.name, BACKWARD, g.shard_numel, dtype, micro)
        self.mark(WAIT, unit.name, BACKWARD, micro=micro)

    def finish_reductions(self, through: UnitSizes | None = None) -> None:
        """``Engine.finish_reductions``: the pending ones in launch order, up to ``through``."""
        while self.pending:
            unit, micro = self.pending.pop(0)
            self.finish(unit, micro)
            if unit is through:
                break

    def reap(self) -> None:
        """``Engine.reap_finished``: the oldest while more than the cap are pending (stages 2-3)."""
        while self.policy.transient_grads and len(self.pending) > self.options.max_inflight_reductions:
            unit, micro = self.pending.pop(0)
            self.finish(unit, micro)

    def launch_ready(self) -> None:
        """``Engine._launch_ready``: in the fixed order, each unit whose grads are in (a frozen one always)."""
        while self.launched < len(self.units) and (self.units[self.launched].name in self.ready
                                                   or not self.units[self.launched].trainable):
            self.launch(self.units[self.launched])
            self.launched += 1
        self.reap()

    def launch_rest(self) -> None:
        """Every unit not launched yet, in the fixed order (a frozen one launches nothing), then the reap."""
        for unit in self.units[self.launched:]:
            self.launch(unit)
        self.launched = len(self.units)
        self.reap()

    def grads_complete(self, unit: UnitSizes, defers: bool) -> None:
        """The last grad of ``unit`` arrived (``Engine._on_grad``)."""
        if self.policy.shard_params and not unit.is_root:
            self.reshard(unit)
        if not defers:
            self.ready.add(unit.name)
            self.launch_ready()

    # -- one micro-step -----------------------------------------------------------------------
    def micro_step(self, micro: int, *, sync: bool, recorded: bool) -> None:
        self.micro = micro
        # Engine.defers_reduction: inside no_sync, stages 0-1 always, stages 2-3 when accumulating unsharded.
        defers = not sync and (not self.policy.transient_grads or self.options.accumulation == "unsharded")
        self.finish_reductions()  # the model's forward pre-hook
        self.launched, self.ready = 0, set()
        if self.policy.shard_params:
            self._forward(recorded)
            self._backward_sharded(defers)
        else:
            # The blocks' tp all-reduces, in their own order: where they fall between the buckets'
            # reductions (other groups) is not modelled at these stages.
            self._forward_bucketed()
            self._backward_bucketed(defers)
        self._finish_backward(defers)

    def pipeline(self, order: Sequence[tuple[str, int]], *, first_step: bool) -> None:
        """A pipeline stage's microbatches in torch's order, all inside ``no_sync``, then the one
        reduction of what they left unreduced (``Engine.reduce_accumulated``)."""
        defers = not self.policy.transient_grads or self.options.accumulation == "unsharded"
        forwards = 0
        split = False
        for kind, micro in order:
            self.action = kind
            if kind not in ("F", "B", "I", "W"):
                raise ValueError(f"pipeline_order takes forwards ('F', mb), backwards ('B', mb) and a split "
                                 f"backward's input and weight halves ('I', 'W'), got {kind!r}")
            self.micro = micro
            if kind == "F":
                self.finish_reductions()  # the model's forward pre-hook
                if self.policy.shard_params:
                    self._forward(recorded=not (first_step and forwards == 0))
                else:
                    self._forward_bucketed()
                forwards += 1
                continue
            self.launched, self.ready = 0, set()  # each backward reduces (or collects) every unit again
            if kind in ("I", "W"):
                split = True
                self._split_half(kind, defers)
                continue
            if self.policy.shard_params:
                self._backward_sharded(defers)
            else:
                self._backward_bucketed(defers)
            self._finish_backward(defers)
        self.action = ""  # what follows is the step's, after the schedule
        if split and self.policy.shard_params:  # Engine.split_backward_done: the root too
            for unit in self.units:
                self.reshard(unit)
        if defers:
            self.launch_rest()  # Engine.reduce_accumulated

    def _split_half(self, kind: str, defers: bool) -> None:
        """One half of a zero-bubble backward on a stage after the first (zeroshard/parallel/pipeline/stage.py):
        stage 3 gathers every unit first (``Engine.gather_for_split_backward``), and frees the blocks
        after it; the weight half's grads are then taken (``Engine.take_assigned_grads``), reduced
        at once, every unit in the fixed order, where the stage reduces every microbatch."""
        if self.policy.shard_params:
            for unit in self.units:
                self.gather(unit, BACKWARD)
            for unit in self.units:
                self.mark(WAIT, unit.name, BACKWARD)
        for unit in self.units:
            self.compute(unit.name if self.policy.shard_params else "", BACKWARD, 0.5)
        if kind == "W" and not defers:
            self.launch_rest()
        if self.policy.shard_params:
            for unit in self.units:
                if not unit.is_root:
                    self.reshard(unit)

    def _forward_bucketed(self) -> None:
        self.compute("", FORWARD)
        if self.tp is not None:
            self.tensor_parallel(FORWARD, self.tp.per_block * self.tp.blocks)
        for _ in range(self.cp.blocks if self.cp is not None else 0):
            self.context_parallel(FORWARD)

    def _backward_bucketed(self, defers: bool) -> None:
        """Stages 0-2: the loss and head, then the buckets in reduction order (after ``_forward_bucketed``)."""
        self.compute("", BACKWARD)
        placed = all(u.blocks is not None for u in self.units)
        sized = self.tp or self.cp
        n = sized.blocks if sized is not None else sum(u.blocks or 0 for u in self.units)
        last_of = {b - 1: b - a for a, b in segment_bounds(self.options.checkpointing, n)}
        if sized is not None and not placed:
            for block in reversed(range(n)):
                self.block_backward_tp(last_of.get(block))
        block = n - 1  # backward runs the blocks in reverse module order
        for unit in self.units:  # buckets complete in reduction order
            if placed and unit.blocks:
                for _ in range(unit.blocks):
                    self.compute(unit.name, BACKWARD, 1.0 / unit.blocks)
                    self.block_backward_tp(last_of.get(block))
                    block -= 1
            else:
                self.compute(unit.name, BACKWARD)
            if unit.trainable:
                self.grads_complete(unit, defers)

    def _forward(self, recorded: bool) -> None:
        blocks = [u for u in self.forward if not u.is_root]
        kept = {blocks[-1].name} if recorded and self.options.reshard_after_forward and blocks else set()
        k = self.options.prefetch

        def enter(unit: UnitSizes) -> None:
            self.gather_and_wait(unit, FORWARD)
            if recorded:
                at = self.index[unit.name] + 1
                for later in self.forward[at:at + k]:
                    self.gather(later, FORWARD)
            # The root's entry is the embedding lookup, counted with the head, where forward ends.
            if not unit.is_root:
                self.compute(unit.name, FORWARD)
                if self.tp is not None:  # its attention's and MLP's outputs
                    self.tensor_parallel(FORWARD, self.tp.per_block)
                self.context_parallel(FORWARD)

        def leave(unit: UnitSizes) -> None:
            if self.options.reshard_after_forward and not unit.is_root and unit.name not in kept:
                self.reshard(unit)

        if self.root is not None:
            enter(self.root)
        first_of = {seg[0].name: seg for seg in self.segments}
        i = 0
        while i < len(blocks):
            segment = first_of.get(blocks[i].name, [blocks[i]])
            enter(segment[0])
            for member in segment[1:]:  # run inside the first unit's call (recompute.py)
                enter(member)
                leave(member)
            leave(segment[0])
            i += len(segment)
        # The root is left at forward's end and stays gathered into backward.
        if self.root is not None:
            self.compute(self.root.name, FORWARD)

    def _prefetch_backward(self, unit: UnitSizes) -> None:
        at = self.index.get(unit.name)
        if at is None:
            return
        for earlier in self.forward[max(0, at - self.options.prefetch):at][::-1]:
            self.gather(earlier, BACKWARD)

    def _backward_sharded(self, defers: bool) -> None:
        last_of = {seg[-1].name: seg for seg in self.segments}
        if self.root is not None:  # backward starts at the loss: the root's output
            self.gather_and_wait(self.root, BACKWARD)
            if self.recomputes:
                self._prefetch_backward(self.root)
            self.compute(self.root.name, BACKWARD)  # the loss and head; the embeddings' grads come last
        at = self.options.backward_prefetch_at
        for unit in reversed([u for u in self.forward if not u.is_root]):
            self.gather_and_wait(unit, BACKWARD)  # Engine._pre_backward
            if self.recomputes:
                self._prefetch_backward(unit)
            segment = last_of.get(unit.name)
            if segment is not None:
                # The first unpack rebuilds the whole segment: its sharded units are gathered, and
                # checkpoint's early stop ends the rebuild before they are released.
                for member in segment:  # Engine.gather_for_recompute, one after another
                    self.gather_and_wait(member, RECOMPUTE)
                for member in segment:
                    self.compute(member.name, RECOMPUTE)
            if unit.trainable and not self.recomputes:
                self.compute(unit.name, BACKWARD, at)
                self._prefetch_backward(unit)  # once part of its grads are in
                self.compute(unit.name, BACKWARD, 1.0 - at)
            else:
                self.compute(unit.name, BACKWARD)
            self.block_backward_tp(None if segment is None else len(segment))
            if unit.trainable:
                self.grads_complete(unit, defers)
        if self.root is not None and self.root.trainable:
            self.grads_complete(self.root, defers)  # the embeddings' grads come last

    def _finish_backward(self, defers: bool) -> None:
        """``Engine._finish_backward``: launch what is left, reap, free every unit (stage 3)."""
        if not defers:
            self.launch_rest()
        if self.policy.shard_params:
            for unit in self.units:
                self.reshard(unit)

    # -- the optimizer step -------------------------------------------------------------------
    def optimizer_step(self, *, clip: bool) -> None:
        if clip:  # zeroshard/runtime/clip.py: every grad shard is read, then the squares summed
            self.finish_reductions()
            if self.policy.shard_optimizer and self.mesh.zero_shard > 1:
                self._emit("all_reduce", "shard", "", CLIP, 2, torch.float64)
            if self.mesh.tp > 1:
                self._emit("all_reduce", "tp", "", CLIP, 1, torch.float64)
        if self.options.offload.enabled:  # the whole-shard step (optim.py): every reduction, then every sync
            self.finish_reductions()
            self.compute("", OPTIMIZER)
            for unit in self.units:
                self._sync_params(unit)
        else:
            stages = _pipeline_stages(self.units)
            total = sum(g.segment_numel for u in self.units for g in u.groups)
            for stage in stages:
                if any(unit is stage[-1] for unit, _ in self.pending):
                    self.finish_reductions(through=stage[-1])
                self.compute(stage[0].name, OPTIMIZER, sum(g.segment_numel for u in stage for g in u.groups) / total)
                for unit in stage:
                    self._sync_params(unit)
        self.finish_reductions()  # zero_grad: a unit whose shard here is all padding

    def _sync_params(self, unit: UnitSizes) -> None:
        if self.policy.gathers_after_step:
            for g in unit.groups:
                if g.trainable:  # a frozen group's values never change
                    self._gather_group(unit, g, PARAM_SYNC)


def _pipeline_stages(units: Iterable[UnitSizes]) -> list[list[UnitSizes]]:
    """``optim._UnitPipeline``: units with optimizer segments on this rank, in reduction order,
    merged until a call covers ``PIPELINE_MIN_NUMEL`` shard elements."""
    stages: list[list[UnitSizes]] = []
    current: list[UnitSizes] | None = None
    numel = 0
    for unit in units:
        own = sum(g.segment_numel for g in unit.groups)
        if not own:
            continue
        if current is None:
            current, numel = [], 0
            stages.append(current)
        current.append(unit)
        numel += own
        if numel >= PIPELINE_MIN_NUMEL:
            current = None
    return stages


def _common_dtype(dtypes: Iterable[torch.dtype]) -> str:
    names = {dtype_name(d) for d in dtypes}
    return names.pop() if len(names) == 1 else "mixed"


# -- a live engine ------------------------------------------------------------------------------
def engine_units(engine: Engine) -> tuple[UnitSizes, ...]:
    """The sizes of a live engine's units, in its reduction order, read from their layouts."""
    return tuple(
        UnitSizes(name=unit.name, is_root=unit.is_root, groups=tuple(
            GroupSizes(numel=g.layout.numel, shard_numel=g.layout.shard_numel, trainable=g.trainable,
                       compute_dtype=g.compute_dtype, reduce_dtype=g.reduce_dtype,
                       optimizer_numel=sum(p.numel for p in g.layout.pieces(g.shard_rank)),
                       ep=g.mesh.ep_size if g.mesh is engine.mesh.experts else 1)
            for g in unit.groups))
        for unit in engine.units)


def engine_schedule(engine: Engine, *, accum: int = 1, first_step: bool = False, clip: bool = False,
                    tp: TensorParallelSizes | None = None,
                    pipeline_order: Sequence[tuple[str, int]] | None = None,
                    cp: ContextParallelSizes | None = None) -> Schedule:
    """``step_schedule`` for a live sharded model's engine (``zeroshard.runtime.get_engine(model)``):
    its units, stage, options, quantized comm and mesh; the forward order it recorded, once it has.
    ``tp``: the blocks' tensor-parallel all-reduces, which the caller sizes from its batch.
    ``pipeline_order``: the engine is a pipeline stage's, run in that order (``step_schedule``).
    ``cp``: the blocks' context-parallel exchanges, which the caller sizes from its scheme and batch."""
    order = [u.name for u in engine.forward_order] or None
    return step_schedule(engine_units(engine), policy=engine.policy, mesh=engine.mesh.dims,
                         options=engine.options, comm=engine.comm, accum=accum, first_step=first_step,
                         forward_order=order, clip=clip, tp=tp, pipeline_order=pipeline_order, cp=cp)
