"""A flat group: the params of one unit that share a dtype and trainability, in one 1-D buffer.

The buffer holds the params at their ``FlatLayout`` offsets; while the group is unsharded every
registered param is a view into it, so an all-gather writes straight into the params with no
copy-out. This rank's ``shard`` is the fp32 master slice the optimizer updates. Whether the full
buffer persists, and whether full grads do, is decided by the stage (see ``StagePolicy``).
[Note: flat buffers] in docs/runtime.md explains the trade-offs against FSDP2's per-param DTensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, cast

import torch
from torch import nn

from zeroshard.comm import collectives
from zeroshard.comm.mesh import Mesh
from zeroshard.comm.names import Group, Phase
from zeroshard.comm.quant import CommQuant, ErrorFeedback, QuantizedGather
from zeroshard.runtime import tp
from zeroshard.runtime.events import EngineEvents, EventKind
from zeroshard.runtime.layout import FlatLayout
from zeroshard.runtime.precision import MixedPrecision
from zeroshard.runtime.reduce import GradReducer, ReduceTarget
from zeroshard.runtime.stage_policy import StagePolicy  # re-exported: the engine's and the tools' one table
from zeroshard.runtime.streams import Landings, SideStreams
from zeroshard.runtime.wrap import ParamRef


QUANTIZED_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE)
"""Gathers that feed compute may be quantized; others (state_dict's summon) must be exact."""


def _alias(buffer: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """A view of ``buffer`` with its own version counter.

    ``buffer[a:b].view(shape)`` would share the buffer's version counter, so refilling the buffer
    by all-gather between forward and backward would look like an in-place edit of a tensor saved
    for backward. The values *are* the same, so the param gets a separate counter.
    """
    view = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    # torch accepts (storage, offset, size) with contiguous strides; its stubs list only the 4-argument form.
    view.set_(buffer.untyped_storage(), buffer.storage_offset() + offset, shape)  # type: ignore[call-overload]
    return view


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupConfig:
    """Everything a ``FlatGroup`` is built from besides its params; nothing is set on it later.

    The two callbacks are how the group asks its engine for what only the engine knows: the
    reduction order (``before_grad_read``: finish the pending reductions up to this group's, so a
    grad shard read sees its whole step) and the hooks of params made lazily at stage 3's first
    gather (``on_params_created``).
    """

    policy: StagePolicy
    mesh: Mesh
    mp: MixedPrecision
    device: torch.device
    store: Any = None
    events: EngineEvents = dataclasses.field(default_factory=EngineEvents)
    comm: CommQuant = dataclasses.field(default_factory=CommQuant)
    is_root: bool = False
    """The root unit's group: quantized weight gathers leave it exact (``CommQuant.quantizes``)."""
    before_grad_read: Callable[[FlatGroup], None] | None = None
    on_params_created: Callable[[FlatGroup], None] | None = None
    streams: SideStreams | None = None
    """The engine's all-gather and reduce streams on an accelerator; None on the CPU."""
    landings: Landings | None = None
    """With offload to pinned host memory: the engine's device->host grad copies, waited on by event."""


class FlatGroup:
    """The params of one unit that share a dtype and trainability, laid out in one flat buffer.

    ``full`` is the whole buffer in the compute dtype (params are views of it while unsharded);
    ``shard`` is this rank's ``[lo, hi)`` slice of the fp32 (master dtype) values, which the
    optimizer updates; ``grad_full`` and ``grad_shard`` are the same two extents for grads. What
    persists is the stage's choice (``StagePolicy``): stage 0 keeps everything whole, stage 1 adds
    the sharded master and grad shard, stage 2 frees full grads once reduced, stage 3 also frees
    ``full`` between uses and shows the modules 1-D shard params (``sharded_params``) meanwhile.
    The group owns its collectives: ``gather_full`` (all-gather into ``full``), ``launch_reduce`` /
    ``finish_reduce`` (which grads to reduce and where the result goes; the collectives themselves
    are its ``reducer``, a ``GradReducer``) and ``sync_params`` (all-gather of updated shards at
    stages 1-2). It reports grads_collected, reduce_launched and reduce_done to ``events``.
    """

    def __init__(self, *, unit: str, refs: list[ParamRef], trainable: bool, config: GroupConfig) -> None:
        policy, mesh, mp = config.policy, config.mesh, config.mp
        self.config = config
        self.unit = unit
        self.refs = refs
        self.trainable = trainable
        self.policy = policy
        self.mesh = mesh
        self.shards = mesh.shard_size if policy.shard_optimizer else 1
        self.shard_rank = mesh.shard_rank if policy.shard_optimizer else 0
        # A tensor-parallel (DTensor) param is flattened as its tp-local part (FSDP2's 2-D composition).
        self.tp_specs = [tp.spec_of(r.param) for r in refs]
        self.layout = FlatLayout([(r.fqn, tp.local_shape(r.param)) for r in refs], self.shards)
        # A frozen group (an adapter run's base weights) has no master: its values are held only in
        # the compute dtype, sharded as the stage shards params, with no grad or optimizer state.
        self.master_dtype = refs[0].param.dtype if trainable else mp.compute_dtype(refs[0].param.dtype)
        self.compute_dtype = mp.compute_dtype(self.master_dtype)
        self.reduce_dtype = mp.reduction_dtype(self.master_dtype)
        self.lo, self.hi = self.layout.shard_range(self.shard_rank)
        self.device = config.device
        self.events = config.events
        self._init_comm_quant()
        self._init_values()
        self._init_grad_state()

    def _init_comm_quant(self) -> None:
        """Which of this group's collectives are sent quantized (qwZ, qgZ), asked once here."""
        comm, policy = self.config.comm, self.policy
        # Block size when stage 3's weight all-gather is sent quantized, else None.
        self.weight_quant: int | None = comm.block_size if policy.shard_params and \
            comm.quantizes(self.layout.numel, self.config.is_root) else None
        # Block size when this group's grads are reduced quantized (qgZ, stages 2-3), else None.
        self.grad_quant: int | None = comm.block_size if policy.transient_grads and self.trainable and \
            comm.quantizes_grads(self.layout.numel) else None
        # qgZ's carried rounding error, when enabled.
        self.grad_feedback = ErrorFeedback() if self.grad_quant is not None and comm.error_feedback else None

    def _init_values(self) -> None:
        """The param values: ``shard`` (the master slice) and ``full`` (the compute-dtype buffer), as
        the stage keeps them; the original params are released once copied in."""
        # Offloaded masters (zeroshard.runtime.offload) live in their own store, never inside the params.
        self.store = self.config.store if self.trainable else None
        self.aliased = self.compute_dtype == self.master_dtype and not self.policy.shard_params and self.store is None
        # A model built on the meta device has no values yet: buffers start at zero and
        # zeroshard.init replays the model's init into them, keeping only what this rank holds.
        self.from_meta = self.refs[0].param.is_meta
        self.params: list[nn.Parameter] | None = None
        self.shard: torch.Tensor  # both set by the stage's branch below
        self.full: torch.Tensor
        if self.policy.shard_params:
            self._init_sharded_values()
        else:
            self._init_whole_values()
        if self.store is not None:
            self.shard = self._offload_master(self.shard)
        self.sharded_params = self._make_sharded_params() if self.policy.shard_params else None
        for ref in self.refs:
            ref.release()  # otherwise the original full-size params would outlive sharding

    def _init_sharded_values(self) -> None:
        """Stage 3: only this rank's shard is held; ``full`` starts empty."""
        if self.from_meta:
            self.shard = torch.zeros(self.layout.shard_numel, dtype=self.master_dtype, device=self.device)
        else:
            self.shard = self._replicated_originals(self.device)[self.lo:self.hi].clone()
        # Grown, and the params created as views of it, at the first gather; never whole before.
        self.full = torch.empty(0, dtype=self.compute_dtype, device=self.device)

    def _init_whole_values(self) -> None:
        """Stages 0-2: the full buffer persists and the params are views of it from the start."""
        whole = (torch.zeros(self.layout.numel, dtype=self.master_dtype, device=self.device) if self.from_meta
                 else self._replicated_originals(self.device))
        if self.aliased:
            self.full, self.shard = whole, whole[self.lo:self.hi]
        else:
            self.shard = whole[self.lo:self.hi].clone()
            self.full = whole.to(self.compute_dtype)
        del whole
        self._create_params()

    def _init_grad_state(self) -> None:
        """The grad buffers, the reducer, and the caches the hot paths fill once."""
        policy = self.policy
        self.grad_full: torch.Tensor | None = None
        self._grad_shard: torch.Tensor | None = None
        self._landing = 0  # the ticket of a device->host grad copy not yet waited on (Landings)
        self.reducer = GradReducer(ReduceTarget(unit=self.unit, layout=self.layout, shard_rank=self.shard_rank,
                                                lo=self.lo, hi=self.hi, reduce_dtype=self.reduce_dtype,
                                                master_dtype=self.master_dtype, device=self.device),
                                   mesh=self.mesh, shard_optimizer=policy.shard_optimizer)
        self._grad_full_zero = True
        self._swaps: dict[bool, list[tuple[dict, str, nn.Parameter]]] = {}  # register()'s, per side
        self.keeps_grads = not policy.transient_grads
        """Stages 0-1: a complete grad is kept in the flat buffer at once (``take_grad`` has work)."""
        self.any_tp = any(spec is not None for spec in self.tp_specs)
        """Whether any param here is a tp DTensor (its grad may need ``tp.local_grad``): asked once."""
        self._in_place: bool | None = None  # reduce_scatter_lands_in_input, asked once
        self._own: torch.Tensor | None = None  # full[lo:hi] of the buffer _own_of, for the gathers
        self._own_of: torch.Tensor | None = None
        self._full_nbytes = 0
        self._pads: list[torch.Tensor | None] | None = None  # _concat_grads' zeros after each slot
        self._grad_views: list[torch.Tensor] = []
        self._grad_views_of: torch.Tensor | None = None  # the grad buffer the cached views are of
        if self.trainable and not policy.transient_grads:
            self.grad_full = torch.zeros(self.layout.numel, dtype=self.compute_dtype, device=self.device)
            self.attach_grad_views()

    # -- construction -------------------------------------------------------------------------
    def _replicated_originals(self, device: torch.device) -> torch.Tensor:
        whole = torch.zeros(self.layout.numel, dtype=self.master_dtype, device=device)
        with torch.no_grad():
            for slot, ref in zip(self.layout.slots, self.refs):
                whole[slot.offset:slot.end].copy_(tp.local(ref.param.detach()).reshape(-1))
        # Every rank must start from the same values, as DDP guarantees; rank 0's copy wins (among
        # the ranks that hold the same tp part).
        if self.mesh.group_size(self.mesh.dp_name) > 1:
            collectives.broadcast(whole, src=0, group=self.mesh.dp_name, phase=Phase.INIT, unit=self.unit,
                                  mesh=self.mesh)
        return whole

    def _offload_master(self, values: torch.Tensor) -> torch.Tensor:
        assert self.store is not None, "only offloaded masters are allocated in a store"
        master = self.store.allocate(f"{self.unit}-master", values.numel(), values.dtype)
        master.copy_(values)
        return master

    def _create_params(self) -> None:
        self.params = [self._make_param(_alias(self.full, s.offset, s.shape), i)
                       for i, s in enumerate(self.layout.slots)]
        if self.config.on_params_created is not None:
            self.config.on_params_created(self)

    def load_param_values(self, index: int, values: torch.Tensor) -> None:
        """Write param ``index``'s full values (the model's own layout) into whatever of it this rank
        holds: for a tensor-parallel param, this tp rank's part of them first."""
        slot = self.layout.slots[index]
        spec = self.tp_specs[index]
        if spec is not None and spec.shard_dim is not None:
            values = tp.to_local(values.detach(), spec.describe(), self.mesh.tp_rank)
        flat = values.detach().reshape(-1)
        with torch.no_grad():
            if not self.policy.shard_params:
                self.full[slot.offset:slot.end].copy_(flat)
                if self.aliased:
                    return  # the shard is a view of the full buffer
            start, stop = max(slot.offset, self.lo), min(slot.end, self.hi)
            if start < stop:
                self.shard[start - self.lo:stop - self.lo].copy_(flat[start - slot.offset:stop - slot.offset])

    def _make_param(self, data: torch.Tensor, index: int | None = None) -> nn.Parameter:
        spec = self.tp_specs[index] if index is not None else None
        return nn.Parameter(data if spec is None else spec.wrap(data), requires_grad=self.trainable)

    def _as_grad(self, view: torch.Tensor, index: int) -> torch.Tensor:
        """A grad view of the flat buffer, as a DTensor for a tensor-parallel param."""
        spec = self.tp_specs[index]
        return view if spec is None else spec.wrap(view)

    def _make_sharded_params(self) -> list[nn.Parameter]:
        """Per param, the 1-D part of its values this rank owns (empty if none): what the module
        shows outside the unit's forward/backward window, so no freed storage is ever reachable."""
        out = []
        for slot in self.layout.slots:
            start, stop = max(slot.offset, self.lo), min(slot.end, self.hi)
            piece = self.shard[start - self.lo:stop - self.lo] if start < stop else self.shard[:0]
            out.append(self._make_param(piece))
        return out

    # -- registration -------------------------------------------------------------------------
    def register(self, unsharded: bool) -> None:
        swaps = self._swaps.get(unsharded)
        if swaps is None:  # made once per side: stage 3 swaps every unit twice a step
            params = self.created_params() if unsharded else self.sharded_params
            assert params is not None, "sharded params exist at stage 3 only"
            swaps = self._swaps[unsharded] = [(module._parameters, attr, param)  # noqa: SLF001
                                              for ref, param in zip(self.refs, params) for module, attr in ref.places]
        for registered, attr, param in swaps:
            registered[attr] = param  # swaps a registered param; torch has no public API

    # -- full buffer --------------------------------------------------------------------------
    def full_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()

    def free_full(self) -> None:
        self.full.untyped_storage().resize_(0)
        if self.config.streams is not None:
            self.config.streams.freed()

    def gather_full(self, phase: str) -> collectives.Pending | QuantizedGather | None:
        """Rebuild the full buffer from every rank's shard (allocating it if it was freed)."""
        streams = self.config.streams
        if streams is not None and self.shards > 1 and not self._gathers_quantized(phase):
            # The copy-in and the all-gather on their own stream ([Note: side streams]).
            with streams.gathering():
                return self._gather_full(phase)
        return self._gather_full(phase)

    def _gathers_quantized(self, phase: str) -> bool:
        return self.weight_quant is not None and self.shards > 1 and phase in QUANTIZED_PHASES

    def _gather_full(self, phase: str) -> collectives.Pending | QuantizedGather | None:
        if self.params is None:
            self.full = torch.empty(self.layout.numel, dtype=self.compute_dtype, device=self.device)
            self._create_params()
        if self._own is None or self._own_of is not self.full:
            # This rank's slice of the full buffer, made once per buffer (a view survives the resizes).
            self._own, self._own_of = self.full[self.lo:self.hi], self.full
            self._full_nbytes = self.full.numel() * self.full.element_size()
        storage = self.full.untyped_storage()
        if storage.nbytes() < self._full_nbytes:
            storage.resize_(self._full_nbytes)
        own = self._own
        if self.weight_quant is not None and self._gathers_quantized(phase):
            # qwZ: the wire carries int8 + scales; every rank dequantizes, the owner's master stays exact.
            return QuantizedGather(self.full, self.shard, shards=self.shards, block_size=self.weight_quant,
                                   unit=self.unit, phase=phase, mesh=self.mesh)
        if not self.aliased:
            with torch.no_grad():
                # An offloaded master is pinned host memory: its copy up need not block the host.
                own.copy_(self.shard, non_blocking=self.store is not None and self.store.pin)
        if self.shards == 1:
            return None
        return collectives.all_gather(self.full, own, group=Group.SHARD, unit=self.unit, phase=phase, async_op=True,
                                      mesh=self.mesh)

    # -- gradients ----------------------------------------------------------------------------
    def created_params(self) -> list[nn.Parameter]:
        """The unsharded params (views of ``full``): made at construction, or at stage 3 at the first gather."""
        if self.params is None:
            raise RuntimeError(f"unit {self.unit}: its params are created at the first all-gather, not yet run")
        return self.params

    def full_grads(self) -> torch.Tensor:
        """The full flat grad buffer, where the caller knows one exists (stages 0-1, or collected)."""
        if self.grad_full is None:
            raise RuntimeError(f"unit {self.unit}: no full grad buffer (stages 2-3 keep one only while reducing)")
        return self.grad_full

    @property
    def grad_shard(self) -> torch.Tensor | None:
        """The averaged grad of this rank's shard, in the master dtype.

        Reductions launched at the end of backward may still be running: reading waits for them,
        so the optimizer can step the units reduced first while the last ones finish.
        """
        # With offload's host copies (landings), another unit's reduction still running would queue
        # a copy after this read's wait: the hook finishes them all first, so one wait covers the step.
        reading_copies = self.config.landings is not None
        if (self.reducer.reducing or reading_copies) and self.config.before_grad_read is not None:
            self.config.before_grad_read(self)
        self.wait_landed()
        return self._grad_shard

    @grad_shard.setter
    def grad_shard(self, value: torch.Tensor | None) -> None:
        self._grad_shard = value

    def wait_landed(self) -> None:
        """With offload: block until the last device->host grad copy landed (once per copy)."""
        if self._landing and self.config.landings is not None:
            ticket, self._landing = self._landing, 0
            self.config.landings.wait(ticket, "offload.grad_to_host")

    def transient_grads(self) -> list[torch.Tensor]:
        """The grad tensors alive now that the step frees again before the optimizer reads the
        shard: a stage 2-3 full grad buffer, per-param grads still waiting for the rest of their
        unit, a reduction's source, and its output while it is a second shard (to be added into
        the existing one or cast to the master dtype). Stages 0-1's persistent full grads are not
        transient; ``kept_grads`` is."""
        out: list[torch.Tensor] = []
        if self.grad_full is not None and self.policy.transient_grads:
            out.append(self.grad_full)
        if self.policy.transient_grads:
            # At stages 0-1 param.grad is a view of the kept buffer; at 2-3 it waits for the unit.
            out.extend(p.grad for p in self.params or () if p.grad is not None)
        sources, reduced = self.reducer.buffers_in_flight()
        out.extend(sources)
        shard = self._grad_shard
        if reduced is not None and self.policy.shard_optimizer and reduced is not shard and (
                shard is not None or reduced.dtype != self.master_dtype):
            out.append(reduced)
        return out

    @property
    def kept_grads(self) -> torch.Tensor | None:
        """Stages 0-1's full grad buffer, which lives for the whole run (None at stages 2-3)."""
        return None if self.policy.transient_grads else self.grad_full

    def peek_grad_shard(self) -> torch.Tensor | None:
        """The grad shard as it stands, without finishing a pending reduction (for observers, which
        must not change when reductions finish)."""
        return self._grad_shard

    def _kept_grad_views(self) -> list[torch.Tensor]:
        """Per param, its grad as a view of the kept flat grad buffer (stages 0-1), made once per
        buffer: re-attaching them every step and checking a grad against them is then an identity
        test, which matters on deep models, where per-param work is most of the step's overhead."""
        grad_full = self.full_grads()
        if self._grad_views_of is not grad_full:
            self._grad_views = [self._as_grad(grad_full[s.offset:s.end].view(s.shape), i)
                                for i, s in enumerate(self.layout.slots)]
            self._grad_views_of = grad_full
        return self._grad_views

    def attach_grad_views(self) -> None:
        for param, view in zip(self.created_params(), self._kept_grad_views()):
            param.grad = view

    def take_grad(self, index: int) -> None:
        """Param ``index``'s grad for this backward is complete.

        Stages 0-1 keep it in the flat buffer (a no-op when autograd accumulated into our view).
        Stages 2-3 leave it on the param until the unit is ready (``collect_grads``): allocating the
        flat buffer at the first grad would hold the whole unit's grads while the unit's backward,
        the step's memory peak, has produced only a few of them.
        """
        self._grad_full_zero = False  # (read at stages 0-1 only, where the buffer is kept)
        if self.policy.transient_grads:
            return
        param, attached = self.created_params()[index], self._kept_grad_views()[index]
        if param.grad is attached:  # autograd accumulated into our view: the usual case
            return
        slot = self.layout.slots[index]
        view = self.full_grads()[slot.offset:slot.end].view(slot.shape)
        grad = tp.local_grad(param.grad, self.tp_specs[index])
        if grad is None or grad.data_ptr() == view.data_ptr():
            return
        with torch.no_grad():
            # A foreign grad here means someone reset param.grad (e.g. model.zero_grad()), so it is
            # the whole gradient, not an increment.
            view.copy_(grad)
            param.grad = self._as_grad(view, index)

    def collect_grads(self) -> None:
        """Stages 2-3: move the params' grads into the flat buffer, in ``reduce_dtype``, and free them."""
        if not self.policy.transient_grads:
            return
        fresh = self.grad_full is None
        params = self.params or ()
        grads = [p.grad for p in params]
        if fresh and grads and not self.any_tp and all(g is not None and g.dtype == self.reduce_dtype for g in grads):
            # Every grad present: one concatenation fills the buffer.
            self.grad_full = self._concat_grads(cast(list[torch.Tensor], grads))
        else:
            if fresh:
                self.grad_full = torch.empty(self.layout.numel, dtype=self.reduce_dtype, device=self.full.device)
                self._zero_where_no_grad(params)
            with torch.no_grad():
                for slot, param, spec in zip(self.layout.slots, params, self.tp_specs):
                    if param.grad is None:
                        continue
                    view = self.full_grads()[slot.offset:slot.end].view(slot.shape)
                    grad = tp.local_grad(param.grad, spec)
                    # The buffer may carry earlier micro-steps (unsharded accumulation), so add unless fresh.
                    view.copy_(grad) if fresh else view.add_(grad)
        # Reported while the per-param grads and the buffer are both alive: the moment of the peak.
        # Releasing the grads after the loop rather than one by one changes no peak: the buffer was
        # allocated while every one of them was alive.
        if self.events.active:
            self.events.emit(EventKind.GRADS_COLLECTED, self.unit, Phase.BACKWARD, self.full_grads().nbytes)
        for param in params:
            param.grad = None

    def _concat_grads(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The flat grad buffer as one concatenation of the grads and the zeros of the padding between
        them (made once per group): the same values as copying each grad into its slot of a buffer
        whose padding was zeroed, with one kernel and no per-param view of the buffer."""
        if self._pads is None:
            ends = [s.offset + s.span for s in self.layout.slots]
            gaps = [s.span - s.numel for s in self.layout.slots]
            gaps[-1] += self.layout.numel - ends[-1]
            zeros = {n: torch.zeros(n, dtype=self.reduce_dtype, device=self.full.device) for n in set(gaps) if n}
            self._pads = [zeros.get(n) for n in gaps]
        chunks: list[torch.Tensor] = []
        for grad, pad in zip(grads, self._pads):
            chunks.append(grad.reshape(-1))
            if pad is not None:
                chunks.append(pad)
        return torch.cat(chunks)

    def _zero_where_no_grad(self, params) -> None:
        """Zero the parts of a fresh grad buffer no grad will be copied into (padding, unused params),
        instead of the whole buffer: the copies overwrite the rest."""
        covered = 0
        has_grad = [p.grad is not None for p in params] or [False] * len(self.layout.slots)
        for slot, filled in zip(self.layout.slots, has_grad):
            if filled:
                if slot.offset > covered:
                    self.full_grads()[covered:slot.offset].zero_()
                covered = slot.end
        if covered < self.layout.numel:
            self.full_grads()[covered:].zero_()

    def _reduces_in_place(self) -> bool:
        """Whether this unit's grads are reduced where they lie (gloo at stages 2-3, grads not yet
        collected): no flat copy, and no unit-sized buffer beside the grads at the moment the unit
        completes (the step's late memory peak)."""
        if not (self.policy.shard_optimizer and self.policy.transient_grads and self.grad_full is None
                and self.params is not None):
            return False
        if self._in_place is None:
            self._in_place = collectives.reduce_scatter_lands_in_input(Group.SHARD, self.mesh)
        return self._in_place

    def launch_reduce(self, phase: str = Phase.BACKWARD) -> None:
        if self.grad_quant is not None and self.shards > 1:
            # qgZ: int8 pieces through an all-to-all, summed in fp32 by their owner.
            self.collect_grads()
            self.reducer.launch_quantized(self.full_grads(), self.grad_quant, phase, feedback=self.grad_feedback)
            self._report_launch(phase)
            return
        pieces = None
        if self._reduces_in_place():  # (never for a unit that did not run: its params were not created)
            params = self.created_params()
            pieces = self.reducer.pieces([tp.local_grad(p.grad, spec) for p, spec in zip(params, self.tp_specs)]
                                         if self.any_tp else [p.grad for p in params])
        if pieces is not None:
            for param in self.created_params():
                param.grad = None  # the pieces keep the storages alive until finish_reduce
            self.reducer.launch_pieces(pieces, phase)
            self._report_launch(phase)
            return
        self.collect_grads()
        grad_full = self.full_grads()
        streams = self.config.streams
        with streams.reducing() if streams is not None else contextlib.nullcontext():
            # On an accelerator the cast (packing) and the collective run on the reduce stream.
            source = grad_full if grad_full.dtype == self.reduce_dtype else grad_full.to(self.reduce_dtype)
            self.reducer.launch_whole(source, phase)
        self._report_launch(phase)

    def _report_launch(self, phase: str) -> None:
        if self.events.active:
            nbytes = self.layout.param_numel * self.reduce_dtype.itemsize
            self.events.emit(EventKind.REDUCE_LAUNCHED, self.unit, phase, nbytes)

    def finish_reduce(self, phase: str = Phase.BACKWARD) -> None:
        """Wait for the reduction and leave the averaged fp32 grad of this rank's shard in ``grad_shard``."""
        reduced = self.reducer.finish(phase)
        if self.store is not None:
            # The optimizer steps where the masters live; pinned memory lets this copy overlap. The
            # host must not read the copy before it lands: every read waits for ``_landing`` first.
            reduced = reduced.to(self.shard.device, non_blocking=self.store.pin)
            if self.config.landings is not None:
                self._landing = self.config.landings.copied()
        if self._grad_shard is not None and self.policy.shard_optimizer:
            self.wait_landed()  # the host adds the copy into the shard it accumulates
            self._grad_shard.add_(reduced)
        else:
            self._grad_shard = reduced
        if self.policy.transient_grads:
            self.grad_full = None
        elif self.policy.shard_optimizer:
            # The reduce-scatter consumed the full grads (its input is scratch), and grad_shard now
            # holds their reduced sum; a further backward without zero_grad must start from zero
            # so that grad_shard accumulates exactly what it adds.
            self.full_grads().zero_()
            self._grad_full_zero = True
        if self.events.active:
            self.events.emit(EventKind.REDUCE_DONE, self.unit, phase, reduced.nbytes)

    @property
    def reducing(self) -> bool:
        return self.reducer.reducing

    @property
    def reduce_done(self) -> bool:
        return self.reducer.done

    def zero_grad(self) -> None:
        self.grad_shard = None
        if self.grad_full is not None and not self.policy.transient_grads:
            if not self._grad_full_zero:
                self.grad_full.zero_()
                self._grad_full_zero = True
            self.attach_grad_views()
        elif self.policy.transient_grads:
            self.grad_full = None
            for param in self.params or ():
                param.grad = None

    # -- after the optimizer step -------------------------------------------------------------
    def sync_params(self) -> collectives.Pending | None:
        """Publish updated masters to the compute params (stages 0-2; stage 3 gathers lazily)."""
        if self.policy.shard_params or not self.trainable:  # frozen values never change
            return None
        if not self.policy.shard_optimizer:
            if not self.aliased:
                with torch.no_grad():
                    self.full.copy_(self.shard)
            return None
        pending = self.gather_full(phase=Phase.PARAM_SYNC)
        assert not isinstance(pending, QuantizedGather)  # only compute-feeding phases are quantized
        return pending
