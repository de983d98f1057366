"""The runtime behind ``zs.shard``: builds the units and drives them from forward/backward hooks.

One engine serves every stage; ``StagePolicy`` decides what is sharded. The lifecycle, the hooks
and the memory contract of each stage are explained in docs/runtime.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
from torch import nn

from zeroshard.comm.mesh import Mesh
from zeroshard.comm.names import Phase
from zeroshard.comm.quant import CommQuant
from zeroshard.runtime.offload import make_store
from zeroshard.runtime.attached import attach_engine, find_engine, get_engine
from zeroshard.runtime.compiled import eager_hook, refuse_traced
from zeroshard.runtime.events import EngineEvents
from zeroshard.runtime.flat import FlatGroup, GroupConfig, StagePolicy
from zeroshard.runtime import host_clock as hc
# The defaults live with the options; re-exported here, where the planner and simulator read them.
from zeroshard.runtime.options import BACKWARD_PREFETCH_AT, MAX_INFLIGHT_REDUCTIONS, EngineOptions
from zeroshard.runtime.precision import MixedPrecision
from zeroshard.runtime.grouping import merge_in_order, reduction_buckets, split_groups
from zeroshard.runtime.recompute import Recompute, segment_length
from zeroshard.runtime.snapshot import MemorySnapshot, TrainingState
from zeroshard.runtime.reduce_queue import ReductionQueue
from zeroshard.runtime import split_backward
from zeroshard.runtime.streams import Landings, side_streams
from zeroshard.runtime.unit import FullTally, Unit, UnitState
from zeroshard.runtime.wrap import BUCKET_JOIN, UnitSpec

__all__ = ["BACKWARD_PREFETCH_AT", "MAX_INFLIGHT_REDUCTIONS", "Engine", "ExecutionOrderError", "MemorySnapshot",
           "TrainingState", "attach_engine", "find_engine", "get_engine", "merge_in_order", "reduction_buckets"]


class ExecutionOrderError(RuntimeError):
    """Units ran in a different order than in the first step, so prefetching would be wrong."""


def _tensors_in(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors_in(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors_in(item)]
    return []


class Engine:
    """The runtime of one sharded model: its units, the hooks that drive them, and the reduction order.

    ``zs.shard`` builds one per model. At stage 3 each unit is one wrapped module whose params are
    all-gathered in a forward pre-hook (with ``prefetch`` later units, in the order recorded in the
    first step) and resharded after; at stages 0-2 units are buckets of about ``bucket_bytes`` whose
    params stay whole. Post-accumulate-grad hooks mark params ready; a unit whose grads are all in
    launches its reduction, strictly in ``reduce_order`` so every rank issues the same collectives.
    Reductions are finished (waited on, full grads freed) in that same order: when a grad shard is
    read (optimizer, clipping), at the next forward, when too many are in flight, and, without a
    replicate group, as soon as they are done (``reap_finished`` says why hybrid waits).
    Every knob is in ``options`` (an ``EngineOptions``); the engine owns what they call for: the
    offload ``store``, the activation ``recompute`` and, once ``materialize`` or a load ran,
    ``init_stats``. Observers subscribe to ``events`` (zeroshard/runtime/events.py).
    See docs/runtime.md for the lifecycle and memory contract of each stage.
    """

    def __init__(self, model: nn.Module, specs: list[UnitSpec], *, policy: StagePolicy, mesh: Mesh,
                 mp: MixedPrecision, device: torch.device, options: EngineOptions | None = None,
                 comm: CommQuant | None = None) -> None:
        self.model = model
        self.policy = policy
        self.mesh = mesh
        self.mp = mp
        self.options = options = options or EngineOptions()
        self.sync_grads = True
        self.events = EngineEvents()
        self.store = make_store(options.offload, device, mesh.rank)
        # How the params got their values: replicated from the model as built, unless materialize ran.
        self.init_stats: dict[str, Any] = {"path": "replicated", "peak_temp_bytes": 0}
        self.comm = comm or CommQuant()
        self._unit_of_group: dict[int, Unit] = {}  # filled once the units exist; the callbacks read it
        # On an accelerator: the all-gather and reduce streams ([Note: side streams]); None on the CPU.
        self.streams = side_streams(device)
        self._tally = FullTally()
        self.units = self._build_units(specs, self._group_config(device))
        self._unit_of_group = {id(g): u for u in self.units for g in u.groups}
        # Reductions launch and finish strictly in the units' order on every rank.
        self.reductions = ReductionQueue(list(self.units))
        self._init_step_state()
        self.unit_of_module = {id(u.module): u for u in self.units if u.module is not None} \
            if policy.shard_params else {}
        self._install_hooks(model)
        blocks = [spec.module for spec in specs if not spec.is_root]
        self.recompute: Recompute | None = None
        if segment_length(options.checkpointing, len(blocks)) is not None:
            self.recompute = Recompute(model, blocks, options.checkpointing, self if policy.shard_params else None)

    def _group_config(self, device: torch.device) -> GroupConfig:
        """What every flat group is built from; the callbacks are how a group asks this engine."""
        return GroupConfig(policy=self.policy, mesh=self.mesh, mp=self.mp, device=device, store=self.store,
                           events=self.events, comm=self.comm, before_grad_read=self._before_grad_read,
                           on_params_created=self._on_params_created, streams=self.streams,
                           landings=Landings(device) if self.store is not None and self.store.pin else None)

    def _build_units(self, specs: list[UnitSpec], config: GroupConfig) -> list[Unit]:
        """The units in backward order: one per wrapped module at stage 3, else buckets of about
        ``bucket_bytes`` (whose params stay whole, so they are registered once here)."""
        root_config = dataclasses.replace(config, is_root=True)
        # specs arrive as [blocks in module order..., root]; backward runs roughly in reverse.
        backward_order = [s for s in reversed(specs) if not s.is_root] + [s for s in specs if s.is_root]
        if self.policy.shard_params:
            return [Unit(s.name, s.module, split_groups(s.name, s.refs, root_config if s.is_root else config),
                         is_root=s.is_root, sharded=True, events=self.events, tally=self._tally)
                    for s in backward_order]
        units = []
        for bucket in reduction_buckets(backward_order, self.options.bucket_bytes):
            name = BUCKET_JOIN.join(s.name for s in bucket)
            refs = [r for s in bucket for r in s.refs]
            is_root = any(s.is_root for s in bucket)
            units.append(Unit(name, None, split_groups(name, refs, root_config if is_root else config),
                              is_root=is_root, sharded=False, events=self.events, tally=self._tally))
            for group in units[-1].groups:
                group.register(unsharded=True)
        return units

    def _init_step_state(self) -> None:
        """Where the engine is in a step, the recorded forward order and the memory counters."""
        self.state = TrainingState.IDLE
        self._forward_order: list[Unit] = []
        self._order_recorded = False
        self._order_index: dict[Unit, int] = {}  # position in _forward_order, once recorded
        self._kept_unit: Unit | None = None  # kept_for_backward()'s unit, once the order is recorded
        self._position = 0
        self._prefetch_after_first_grad: Unit | None = None
        # [Note: frozen params at stage 3] units whose input grads are still to come, and those of
        # them whose own grads are all in (resharded once their input grads are too).
        self._awaiting_inputs: set[Unit] = set()
        self._held: set[Unit] = set()
        self.peak_full_bytes = 0
        self.max_unsharded_units = 0

    def _install_hooks(self, model: nn.Module) -> None:
        """The model's and the params' hooks."""
        # None unless built inside host_clock.recording(): then the hooks below are timed ones.
        self.host_clock = clock = hc.requested()
        # Made once: the pre-backward hook is registered every forward, the end-of-backward callback queued every backward.
        self._pre_backward_hooks = {u: hc.timed_if(clock, hc.PRE_BACKWARD, functools.partial(self._pre_backward, u))
                                    for u in self.units}
        self._finish_backward_callback = hc.timed_if(clock, hc.POST_BACKWARD, self._finish_backward)
        if clock is not None:
            self._instrument(clock)
        self._hooks = []
        # Reductions left running after a backward finish at the next forward at the latest, so
        # they never add their full grads to that forward's activations (gradient accumulation).
        self._hooks.append(model.register_forward_pre_hook(eager_hook(hc.timed_if(clock, hc.PRE_FORWARD,
                                                                                   self._begin_forward))))
        self._hooks.append(model.register_forward_hook(eager_hook(hc.timed_if(clock, hc.POST_FORWARD,
                                                                               self._end_forward))))
        self._register_grad_hooks()
        if self.policy.shard_params:
            self._register_forward_hooks()

    def materialize(self, init_fn: Callable[[nn.Module], None] | None, *, require_all: bool = True) -> None:
        """Give a model built on the meta device its values by replaying its init, shard by shard
        (zeroshard/runtime/materialize.py); ``init_stats`` records how."""
        from zeroshard.runtime.materialize import materialize  # it drives this engine: imported when used

        self.init_stats = materialize(self.model, self, init_fn, require_all=require_all)

    def replay_constructor(self, built: Any) -> None:
        """Give this engine's shards the values a recorded build function produced, one param at a
        time (zeroshard/runtime/construct.py); ``init_stats`` records how."""
        self.init_stats = built.load(self)

    def values_loaded_from(self, source: str) -> None:
        """Record that the params' values came from ``source`` (a checkpoint or a pretrained folder)
        rather than from an init, for the run summary."""
        self.init_stats = {**self.init_stats, "path": source}

    # -- hook registration --------------------------------------------------------------------
    def _instrument(self, clock: hc.HostClock) -> None:
        """Time the units' reductions and the groups' copies into the params (host_clock.KINDS)."""
        for unit in self.units:
            clock.instrument(unit, "launch_reduce", hc.REDUCE)
            clock.instrument(unit, "finish_reduce", hc.REDUCE)
            for group in unit.groups:
                clock.instrument(group, "gather_full", hc.PARAM_COPY)
                clock.instrument(group, "sync_params", hc.PARAM_COPY)

    def _register_grad_hooks(self) -> None:
        """Hooks on the params that exist now; stage 3 creates its params at the first gather,
        and ``_on_params_created`` hooks those then."""
        for unit in self.units:
            for group in unit.groups:
                if group.trainable and group.params is not None:
                    self._register_group_hooks(unit, group)

    def _on_params_created(self, group: FlatGroup) -> None:
        unit = self._unit_of_group.get(id(group))
        # None while the engine is still building its units: _register_grad_hooks hooks those.
        if unit is not None and group.trainable:
            self._register_group_hooks(unit, group)

    def _before_grad_read(self, group: FlatGroup) -> None:
        # With offload on an accelerator every read waits for the grads' copies to the host: finish
        # every pending reduction first, so their copies are all queued and one wait covers them
        # (reading unit by unit would wait once per unit). Elsewhere the optimizer may step the units
        # reduced first while the last ones finish.
        self.finish_reductions(None if group.config.landings is not None else self._unit_of_group[id(group)])

    def _register_group_hooks(self, unit: Unit, group: FlatGroup) -> None:
        group_index = unit.groups.index(group)
        for pi, param in enumerate(group.created_params()):
            hook = hc.timed_if(self.host_clock, hc.POST_BACKWARD, functools.partial(self._on_grad, unit, group_index, pi))
            self._hooks.append(param.register_post_accumulate_grad_hook(hook))

    def _register_forward_hooks(self) -> None:
        clock = self.host_clock
        for unit in self.units:
            pre = hc.timed_if(clock, hc.PRE_FORWARD, functools.partial(self._pre_forward, unit))
            post = hc.timed_if(clock, hc.POST_FORWARD, functools.partial(self._post_forward, unit))
            self._hooks.append(unit.module.register_forward_pre_hook(eager_hook(pre)))
            self._hooks.append(unit.module.register_forward_hook(eager_hook(post)))

    # -- stage 3 forward ----------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, module, args) -> None:
        if self.recompute is not None and self.recompute.begin_cached_call(module, args):
            return  # the unit already ran inside its checkpointed segment
        self.enter_unit(unit)
        self._hold_until_input_grads(unit, args)

    def _hold_until_input_grads(self, unit: Unit, args) -> None:
        """[Note: frozen params at stage 3] A unit with frozen params (an adapter's base weights) is
        not done with its full params when its trainable grads are all in: backward still multiplies
        by the frozen weights to reach the unit's inputs (a LoRA layer's input grad runs through its
        base weight). So such a unit reshards once both its grads and its inputs' grads are in, the
        latter seen by a grad hook on the inputs, as FSDP2's post-backward hook on a module's inputs.
        A unit whose inputs need no grad is done at its last param grad, as any other."""
        if not (self.policy.shard_params and torch.is_grad_enabled() and not unit.is_root
                and len(unit.trainable_groups) < len(unit.groups)):
            return
        tensors = [t for t in _tensors_in(args) if t.requires_grad]
        if tensors:
            self._awaiting_inputs.add(unit)
            torch.autograd.graph.register_multi_grad_hook(tensors, functools.partial(self._inputs_done, unit),
                                                          mode="all")

    def _inputs_done(self, unit: Unit, grads) -> None:
        self._awaiting_inputs.discard(unit)
        if unit in self._held:
            self._held.discard(unit)
            unit.reshard()

    def enter_unit(self, unit: Unit) -> None:
        tracking = torch.is_grad_enabled()
        if unit.is_root:
            self._position = 0
        if tracking:
            self._check_order(unit)
        unit.unshard(Phase.FORWARD)
        unit.wait_unshard()
        self.track_memory()
        if tracking and self._order_recorded:
            upcoming = self._forward_order[self._position:self._position + self.options.prefetch]
            for later in upcoming:
                later.unshard(Phase.FORWARD)
            self.track_memory()

    def _check_order(self, unit: Unit) -> None:
        if not self._order_recorded:
            self._forward_order.append(unit)
            self._position += 1
            return
        pos = self._position
        expected = self._forward_order[pos] if pos < len(self._forward_order) else None
        if expected is not unit:
            ran = expected.name if expected is not None else "nothing (the recorded order had ended)"
            raise ExecutionOrderError(
                f"unit execution order changed: the first step ran {ran} at position {pos}, this step ran "
                f"{unit.name}. zeroshard records the order in step 1 to prefetch all-gathers; make every step "
                "(and every rank) run the units in the same order, or use one unit for the branching part"
            )
        self._position += 1

    def _post_forward(self, unit: Unit, module, args, output):
        if self.recompute is not None and self.recompute.end_cached_call(module):
            return output
        return self.exit_unit(unit, output)

    def exit_unit(self, unit: Unit, output):
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            tensors = [t for t in _tensors_in(output) if t.requires_grad]
            if len(tensors) == 1:  # the usual block output: its own hook fires once per backward, as "any" would
                tensors[0].register_hook(self._pre_backward_hooks[unit])
            elif tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward_hooks[unit], mode="any")
        if not grad_enabled or (self.options.reshard_after_forward and not unit.is_root and not self._reused_next(unit)):
            unit.reshard()
        if unit.is_root and grad_enabled and not self._order_recorded:
            self._order_recorded = True
            # Read once per unit and step from here on: derived once.
            self._order_index = {u: i for i, u in enumerate(self._forward_order)}
            kept = self.kept_for_backward()
            self._kept_unit = kept[0] if kept else None
        return output

    def kept_for_backward(self) -> list[Unit]:
        """Units that stay gathered from forward into backward (once the order is recorded): the
        last block of forward, which backward needs first, so resharding it would only gather it
        again at once. Holding it costs nothing at the peak, where backward holds it anyway."""
        if not self._order_recorded or not self.options.reshard_after_forward:
            return []
        blocks = [u for u in self._forward_order if not u.is_root]
        return blocks[-1:]

    @property
    def forward_order(self) -> list[Unit]:
        """Stage 3: the units in the order the first step's forward ran them (empty until it has),
        which prefetching follows; zeroshard/runtime/schedule.py reads it."""
        return list(self._forward_order) if self._order_recorded else []

    def _reused_next(self, unit: Unit) -> bool:
        return unit is self._kept_unit

    def gather_for_recompute(self, module) -> bool:
        """Make a unit's full params available to a recompute; True if it had to be gathered."""
        unit = self.unit_of_module.get(id(module))
        if unit is None or unit.state is not UnitState.SHARDED:
            if unit is not None:
                unit.wait_unshard()
            return False
        unit.unshard(Phase.RECOMPUTE)
        unit.wait_unshard()
        self.track_memory()
        return True

    def release_after_recompute(self, module) -> None:
        self.unit_of_module[id(module)].reshard()

    # -- stage 3 backward ---------------------------------------------------------------------
    def _pre_backward(self, unit: Unit, grad) -> None:
        unit.unshard(Phase.BACKWARD)
        unit.wait_unshard()
        self.track_memory()
        if self.recompute is not None:
            # Recomputing a segment needs all of its units at once, before any of its grads.
            self._prefetch_backward(unit)
        else:
            self._prefetch_after_first_grad = unit

    def _prefetch_backward(self, unit: Unit) -> None:
        """Gather the ``prefetch`` units backward runs after ``unit``.

        Issued at ``unit``'s first grad rather than when its backward starts: that moment (every
        activation still saved) is the step's memory peak, and the first grad comes once the
        unit's last layer has freed its inputs, early enough to hide the all-gather behind the rest
        of the unit's backward.
        """
        index = self._order_index.get(unit)
        if index is not None:
            for earlier in self._forward_order[max(0, index - self.options.prefetch):index][::-1]:
                earlier.unshard(Phase.BACKWARD)
            self.track_memory()

    # -- gradient reduction -------------------------------------------------------------------
    @property
    def defers_reduction(self) -> bool:
        """Inside ``no_sync``: keep accumulating full grads locally instead of reducing.

        Stages 0-1 always keep full grads, so deferring is free. Stages 2-3 reduce-scatter every
        micro-step and accumulate into the 1/N grad shard unless ``accumulation="unsharded"``
        asked to trade full-grad memory for fewer reduce-scatters.
        """
        return not self.sync_grads and not self.reduces_inside_no_sync

    @property
    def reduces_inside_no_sync(self) -> bool:
        """Stages 2-3 accumulating sharded: every backward reduces, inside ``no_sync`` too."""
        return self.policy.transient_grads and self.options.accumulation != "unsharded"

    def _on_grad(self, unit: Unit, group_index: int, param_index: int, param) -> None:
        if self.state is not TrainingState.BACKWARD:
            # Asked at a backward's first grad only: compiled autograd traces every grad hook of
            # its graph, the first one included.
            if torch.compiler.is_compiling():
                refuse_traced("compiled autograd is not supported: zeroshard reduces grads from autograd hooks; turn "
                              "torch._dynamo.config.compiled_autograd off and compile the forward "
                              "(zs.shard(compile=True))")
            self.finish_reductions()  # the previous backward's, if nobody has read them yet
            self.state = TrainingState.BACKWARD
            # No public hook marks the end of backward; queue_callback is what torch's own DDP and
            # FSDP2 use. It runs once the whole graph is done, on the same thread.
            torch.autograd.Variable._execution_engine.queue_callback(  # noqa: SLF001 (no public API)
                self._finish_backward_callback)
        ready = unit.mark_ready(group_index, param_index)
        if unit is self._prefetch_after_first_grad and (ready or unit.ready_fraction >= self.options.backward_prefetch_at):
            self._prefetch_after_first_grad = None
            self._prefetch_backward(unit)
        if ready:
            if self.defers_reduction:
                unit.collect_grads()  # accumulate in the flat buffer until the synchronising backward
            if self.policy.shard_params and not unit.is_root:
                if unit in self._awaiting_inputs:
                    self._held.add(unit)  # backward still needs its frozen params
                else:
                    unit.reshard()
            if not self.defers_reduction:
                self._launch_ready()
        elif self.reductions.finished < self.reductions.launched:  # (in_flight, without a call per grad)
            # Free the full grads of reductions that finished meanwhile, not only when the next
            # unit launches: at stages 2-3 they would otherwise overlap the next unit's full grads.
            self.reap_finished()

    @property
    def reduce_order(self) -> list[Unit]:
        """The order every rank launches and finishes the units' reductions in."""
        return self.reductions.order

    def _launch_ready(self) -> None:
        self.reductions.launch_ready()
        self.reap_finished()

    def reap_finished(self) -> None:
        """Finish reductions in order: those already done, and at stages 2-3 the oldest ones while
        more than ``options.max_inflight_reductions`` are pending.

        Finishing frees a unit's full grad buffer. gloo reports an async reduce-scatter complete only
        once it is waited on, so without the cap every full grad of the step would stay alive until
        the end of backward; the cap bounds them to that many units at the cost of some overlap.
        """
        # With a replicate group, finishing runs a blocking all-reduce across replicas, so it must
        # happen at the same point of the program on every rank: a rank finishing early because its
        # reduce-scatter happened to be done would block while a replica waits on it for the next
        # all-gather (a cross-group deadlock). Then only the deterministic cap finishes here.
        # ``options.reap_when_done=False`` asks for that deterministic point always.
        self.reductions.reap(opportunistic=self.mesh.replicate_size == 1 and self.options.reap_when_done,
                             cap=self.options.max_inflight_reductions if self.policy.transient_grads else None)

    def finish_reductions(self, through: Unit | None = None) -> None:
        """Finish pending reductions in launch order, up to and including ``through`` (default all)."""
        self.reductions.finish(through, restart=self.state is not TrainingState.BACKWARD)

    def _begin_forward(self, module, args) -> None:
        self.finish_reductions()
        if self.streams is not None:
            self.streams.begin_step()
        self.state = TrainingState.FORWARD

    def _end_forward(self, module, args, output) -> None:
        self.state = TrainingState.IDLE

    def _finish_backward(self) -> None:
        self.state = TrainingState.IDLE
        self._prefetch_after_first_grad = None
        self._awaiting_inputs.clear()  # every unit reshards below
        self._held.clear()
        if self.defers_reduction:
            for unit in self.units:
                unit.collect_grads()  # units with unused params were never complete
                unit.clear_ready()
                if self.policy.shard_params:
                    unit.reshard()
            return
        # Units with grads still missing (unused params) are reduced with zeros for those params,
        # in the fixed order, so every rank issues the same collectives.
        self.reductions.launch_rest()
        # The last reductions are left running: reading a grad shard (the optimizer, clipping, the
        # scaler) finishes them in order, so the units reduced first can step meanwhile.
        self.reap_finished()
        if self.policy.shard_params:
            for unit in self.units:
                unit.reshard()

    def reduce_accumulated(self) -> None:
        """Launch the reductions of the grads accumulated under ``no_sync`` (a pipeline stage, once
        after its schedule), in the fixed order."""
        if self.sync_grads is False or self.state is TrainingState.BACKWARD:
            raise RuntimeError("reduce_accumulated runs after the backward passes, outside no_sync")
        split_backward.reduce_accumulated(self)

    # -- split backward and grads by name (pipeline schedules: zeroshard/runtime/split_backward.py)
    def input_backward_done(self) -> None:
        """The input half of a split backward ran for one microbatch: stage 3 frees its blocks."""
        self._prefetch_after_first_grad = None
        split_backward.input_backward_done(self)

    def gather_for_split_backward(self) -> None:
        """Stage 3: gather every unit before either half of a split backward."""
        split_backward.gather_for_split_backward(self)

    def split_backward_done(self) -> None:
        """Every microbatch's weight half has run: stage 3 frees every unit, the root included."""
        split_backward.split_backward_done(self)

    def take_assigned_grads(self) -> None:
        """Take the grads a split backward's weight half assigned to ``param.grad`` itself."""
        split_backward.take_assigned_grads(self)

    def accumulated_grad(self, fqn: str) -> torch.Tensor:
        """The full grad of param ``fqn`` accumulated under ``no_sync``, a view a caller may change."""
        return split_backward.accumulated_grad(self, fqn)

    def reduced_grad_piece(self, fqn: str) -> tuple[torch.Tensor, int, int]:
        """This rank's part of param ``fqn``'s reduced grad: ``(view, first, numel)``."""
        return split_backward.reduced_grad_piece(self, fqn)

    # -- optimizer-facing ---------------------------------------------------------------------
    @property
    def groups(self) -> list[FlatGroup]:
        return [g for unit in self.units for g in unit.groups]

    @property
    def trainable_groups(self) -> list[FlatGroup]:
        return [g for g in self.groups if g.trainable]

    def zero_grad(self) -> None:
        self.finish_reductions()  # one finishing later would put stale grads back
        for group in self.trainable_groups:
            group.zero_grad()

    def wait_host_copies(self) -> None:
        """Grad shards reach offloaded masters by async copies; the CPU step must see them landed
        (each group waits for its own copy's event, [Note: side streams])."""
        if self.store is not None:
            for group in self.trainable_groups:
                group.wait_landed()

    def sync_params(self) -> None:
        if self.streams is not None:  # the gathers below read what the optimizer step just wrote
            self.streams.begin_step()
        pending = [p for p in (g.sync_params() for g in self.groups) if p is not None]
        for p in pending:
            p.wait()

    # -- memory accounting --------------------------------------------------------------------
    def memory_snapshot(self) -> MemorySnapshot:
        """The engine's buffers and memory counters as they stand, for tools (the planner's
        measurement, the profiler) that must not read its internals. Never waits on a reduction."""
        groups = self.groups
        return MemorySnapshot(
            state=self.state,
            full_params=[g.full for g in groups], masters=[g.shard for g in groups],
            kept_grads=[t for t in (g.kept_grads for g in groups) if t is not None],
            full_grads=[g.grad_full for g in groups if g.grad_full is not None],
            grad_shards=[t for t in (g.peek_grad_shard() for g in groups) if t is not None],
            transient_grads=[t for g in groups if g.trainable for t in g.transient_grads()],
            live_full_bytes=self.live_full_bytes(), peak_full_bytes=self.peak_full_bytes,
            max_unsharded_units=self.max_unsharded_units, offloaded=self.store is not None)

    def live_full_bytes(self) -> int:
        """Bytes of full-param storage allocated right now, read from the storages themselves."""
        return sum(u.full_bytes() for u in self.units)

    def track_memory(self) -> None:
        # The units' running tally: summing every unit's storages here would cost O(units) per gather.
        tally = self._tally
        if tally.bytes > self.peak_full_bytes:
            self.peak_full_bytes = tally.bytes
        if tally.units > self.max_unsharded_units:
            self.max_unsharded_units = tally.units

    def reset_memory_stats(self) -> None:
        self.peak_full_bytes = 0
        self.max_unsharded_units = 0
