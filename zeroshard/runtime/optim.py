"""The sharded optimizer: any elementwise ``torch.optim`` class over this rank's fp32 master slices.

The optimizer is a real instance of the user's class (so LR schedulers and ``isinstance`` work),
built over *segments*: maximal runs of one param group inside this rank's shard of a flat buffer.
Each segment is a Parameter aliasing the master shard, with a grad aliasing the reduced grad
shard, so optimizer state is 1/N by construction and weight-decay groups hold even when a shard
starts or ends in the middle of a param.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from zeroshard.runtime import guard
from zeroshard.runtime.clip import guard_norm
from zeroshard.runtime.offload.stepper import SlicedStep
from zeroshard.runtime.engine import Engine, find_engine, get_engine
from zeroshard.runtime.events import EventKind
from zeroshard.runtime.flat import FlatGroup
from zeroshard.runtime.layout import decays
from zeroshard.runtime import host_clock as hc
from zeroshard.runtime.optim_kinds import ELEMENTWISE_OPTIMIZERS, PER_TENSOR_OPTIMIZERS, OptimKind
from zeroshard.runtime.optim_parts import Part, build_parts, group_plans, probe, step_parts, unhooked
from zeroshard.runtime.owners import OwnedParam, PerTensorStep, assign_owners

# Re-exported: the classification lives with its own concept (zeroshard/runtime/optim_kinds.py).
__all__ = ["ELEMENTWISE_OPTIMIZERS", "PER_TENSOR_OPTIMIZERS", "decays", "optim_groups", "optimizer", "sharded_state",
           "user_class"]


def optim_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Plain torch param groups of an *unsharded* model, by the same rule ``zs.optimizer`` uses.

    Use it to build a single-process reference that decays exactly the params we do.
    """
    if find_engine(model) is not None:
        raise ValueError("optim_groups takes an unsharded model; for a sharded one use zs.optimizer")
    seen: set[int] = set()
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if decays(name, param.shape) else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclasses.dataclass
class ShardedState:
    """What a sharded optimizer steps with, kept on it as ``optimizer.zeroshard_state``."""

    engine: Engine
    segments: SegmentMap
    sliced_step: SlicedStep | None = None  # disk offload: the step runs slice by slice
    pipeline: _UnitPipeline | None = None  # on-device masters: the step runs unit by unit
    parts: list[Part] | None = None  # several classes, or per-tensor ones: each steps its own groups
    per_tensor: PerTensorStep | None = None  # the params stepped whole on their owners

    def report_step(self) -> None:
        """The ``step`` event: this rank's master values were updated (``bytes``: their size)."""
        events = self.engine.events
        if events.active:
            nbytes = sum(g.shard.nbytes for g in self.engine.trainable_groups)
            events.emit(EventKind.STEP, "", "step", nbytes)


def sharded_state(optimizer: torch.optim.Optimizer) -> ShardedState | None:
    """The sharding state of an optimizer built by ``zs.optimizer``; None for a plain torch one."""
    state = getattr(optimizer, "zeroshard_state", None)
    return state if isinstance(state, ShardedState) else None


def user_class(optimizer: torch.optim.Optimizer) -> type:
    """The class the user asked for: a sharded optimizer is an instance of a subclass of it."""
    cls = type(optimizer)
    return cls.__mro__[1] if sharded_state(optimizer) is not None else cls


_SHARDED_CLASSES: dict[type, type] = {}  # one subclass per user class, so repeated calls share it


def _sharded_class(optim_cls: type[torch.optim.Optimizer]) -> type:
    if optim_cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[optim_cls] = _make_sharded_class(optim_cls)
    return _SHARDED_CLASSES[optim_cls]


def _zero_grad_of(optim_cls: type[torch.optim.Optimizer]):
    """The sharded classes' zero_grad: the user's class drops its grads, the engine its flat ones."""
    def zero_grad(self, set_to_none: bool = True) -> None:
        guard.settle(self.zeroshard_state.engine)  # a flag the update took on the device, while its grads exist
        optim_cls.zero_grad(self, set_to_none=True)
        self.zeroshard_state.engine.zero_grad()

    return zero_grad


def _make_sharded_class(optim_cls: type[torch.optim.Optimizer]) -> type:
    zero_grad = _zero_grad_of(optim_cls)

    def step(self, closure=None):
        state = self.zeroshard_state
        loss = None
        # A non-finite step: every rank skips it. An optimizer that takes the flag on the device
        # (without offload, whose host update would have to wait for it anyway) skips itself.
        if closure is None and guard.should_skip(state.engine, guard_norm,
                                                 self if state.engine.store is None else None):
            return None
        base_step = hc.timed_if(state.engine.host_clock, hc.OPTIMIZER_MATH, unhooked(optim_cls.step))
        try:
            if state.pipeline is None or closure is not None:
                state.segments.attach_grads()
                sliced = state.sliced_step
                loss = sliced(closure) if sliced is not None else base_step(self, closure)
                state.engine.sync_params()
            else:
                state.pipeline.run(self, base_step)
        finally:
            self.__dict__.pop("found_inf", None)  # the guard's flag is this step's only
        state.report_step()
        return loss

    return type(f"Sharded{optim_cls.__name__}", (optim_cls,), {"zero_grad": zero_grad, "step": step})


_PARTS_CLASSES: dict[type, type] = {}


def _sharded_parts_class(optim_cls: type[torch.optim.Optimizer]) -> type:
    """The class of an optimizer made of parts (several classes, or per-tensor ones)."""
    if optim_cls in _PARTS_CLASSES:
        return _PARTS_CLASSES[optim_cls]

    zero_grad = _zero_grad_of(optim_cls)

    def step(self, closure=None):
        state = self.zeroshard_state
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if state.engine.store is not None:  # offload: the host step reads grads the device copies down
            state.engine.finish_reductions()
            state.engine.wait_host_copies()
        if guard.should_skip(state.engine, guard_norm):  # a non-finite step: every rank skips it
            return loss
        state.segments.attach_grads()
        # Owners first: its exchange reads every grad shard, so all reductions are done by then.
        state.per_tensor.load_whole()
        step_parts(self, state.parts)
        state.per_tensor.store_whole()
        state.engine.sync_params()
        state.report_step()
        return loss

    cls = type(f"Sharded{optim_cls.__name__}", (optim_cls,), {"zero_grad": zero_grad, "step": step})
    _PARTS_CLASSES[optim_cls] = cls
    return cls


def _group_index(fqn: str, shape: torch.Size, user_groups: list[dict] | None, name_to_group: dict) -> int:
    if user_groups is None:
        return 0 if decays(fqn, shape) else 1
    if fqn not in name_to_group:
        raise ValueError(f"param {fqn!r} is in no param group; every trainable param must be listed once")
    return name_to_group[fqn]


def _segments(group: FlatGroup, group_of_slot: list[int]) -> list[tuple[int, int, int]]:
    """(param group index, start, stop) runs over this rank's shard, relative to the shard."""
    return [(index, start - group.lo, stop - group.lo)
            for index, start, stop in group.layout.segments(group.shard_rank, group_of_slot.__getitem__)]


class SegmentMap:
    """The optimizer's segment params and where their grads come from."""

    def __init__(self) -> None:
        self.entries: list[tuple[nn.Parameter, FlatGroup, int, int]] = []
        self.group_index: dict[int, int] = {}  # id(segment) -> its torch param group

    def attach_grads(self, groups: set[FlatGroup] | None = None) -> None:
        last, grad = None, None
        for param, group, start, stop in self.entries:
            if groups is None or group in groups:
                if group is not last:  # a group's segments are consecutive: its shard read once
                    last, grad = group, group.grad_shard
                param.grad = None if grad is None else grad[start:stop]


PIPELINE_MIN_NUMEL = 1 << 19
"""Shard elements per pipelined optimizer call, at least (see ``_UnitPipeline``)."""


class _UnitPipeline:
    """Step the optimizer one unit at a time, in the order the reductions were launched.

    Reading a unit's grad shard waits only for the reductions up to it, so the step of the units
    reduced first overlaps the last reductions; at stages 1-2 each unit's param all-gather is
    issued as soon as its masters are updated, overlapping the steps of the units after it. The
    update itself is the user's optimizer on the same segments, so the numbers do not change.
    """

    def __init__(self, engine: Engine, segment_map: SegmentMap, n_groups: int) -> None:
        self.engine = engine
        self.segment_map = segment_map
        # (units, their trainable groups, per torch param group: their segments). Consecutive units
        # are stepped together until a stage has PIPELINE_MIN_NUMEL elements: each optimizer call
        # has a fixed cost, which dominates small units (a model of a few million params takes one).
        self.stages: list[tuple[list, set, list[list[nn.Parameter]]]] = []
        current: tuple[list, set, list[list[nn.Parameter]]] | None = None
        numel = 0
        for unit in engine.reduce_order:
            groups = set(unit.trainable_groups)
            lists: list[list[nn.Parameter]] = [[] for _ in range(n_groups)]
            for param, group, _, _ in segment_map.entries:
                if group in groups:
                    lists[segment_map.group_index[id(param)]].append(param)
            if not any(lists):
                continue
            if current is None:
                current, numel = ([], set(), [[] for _ in range(n_groups)]), 0
                self.stages.append(current)
            current[0].append(unit)
            current[1].update(groups)
            for merged, params in zip(current[2], lists):
                merged.extend(params)
            numel += sum(p.numel() for params in lists for p in params)
            if numel >= PIPELINE_MIN_NUMEL:
                current = None

    def run(self, opt, base_step) -> None:
        originals = [g["params"] for g in opt.param_groups]
        pending = []
        try:
            for units, groups, lists in self.stages:
                self.segment_map.attach_grads(groups)
                for torch_group, params in zip(opt.param_groups, lists):
                    torch_group["params"] = params
                base_step(opt)
                pending += [p for unit in units for p in (g.sync_params() for g in unit.groups) if p is not None]
        finally:
            for torch_group, params in zip(opt.param_groups, originals):
                torch_group["params"] = params
        for p in pending:
            p.wait()


def optimizer(model: nn.Module, optim_cls: type[torch.optim.Optimizer], *, param_groups: list[dict] | None = None,
              elementwise: bool = False, per_tensor: bool = False, **defaults: Any):
    """Build ``optim_cls`` over this rank's shard of a sharded model.

    ``param_groups``, if given, is a list of dicts whose ``"params"`` are param *names* (or the
    params themselves from before ``zs.shard``) plus per-group options. By default two groups are
    made: decaying matrices/embeddings (``weight_decay`` from the keywords) and non-decaying
    biases and norms. A group may name its own class, ``{"params": [...], "optimizer":
    torch.optim.Muon, "lr": 0.02}`` (its options are its own; ``defaults`` go to ``optim_cls``).

    An elementwise class (``ELEMENTWISE_OPTIMIZERS``, or your own declared ``elementwise=True``:
    each element's update reads only its own grad and state) steps flat shard slices. A per-tensor
    class (``PER_TENSOR_OPTIMIZERS``, or your own declared ``per_tensor=True``: it reads one whole
    param at a time) steps each param whole on one owner rank (zeroshard/runtime/owners.py).
    """
    engine = get_engine(model)
    name_to_group, options = _resolve_user_groups(engine, param_groups, defaults)
    plans = group_plans(options, optim_cls, elementwise, per_tensor)
    group_of_slot = {id(g): [_group_index(s.fqn, s.shape, param_groups, name_to_group) for s in g.layout.slots]
                     for g in engine.trainable_groups}
    if all(cls is optim_cls and kind is OptimKind.ELEMENTWISE for cls, kind in plans):
        opt = _flat_optimizer(engine, optim_cls, options, group_of_slot, defaults)
    else:
        opt = _parts_optimizer(engine, optim_cls, options, plans, group_of_slot, defaults)
    if engine.host_clock is not None:  # built inside host_clock.recording(): its step is timed too
        engine.host_clock.instrument(opt, "step", hc.OPTIMIZER)
        engine.host_clock.instrument(opt, "zero_grad", hc.OPTIMIZER)
    return opt


def _flat_segments(engine: Engine, group_of_slot: dict[int, list[int]], n_groups: int,
                   flat: set[int]) -> tuple[SegmentMap, list[list[nn.Parameter]]]:
    """The segment params of the torch groups in ``flat``, per torch group."""
    segment_map = SegmentMap()
    buckets: list[list[nn.Parameter]] = [[] for _ in range(n_groups)]
    for group in engine.trainable_groups:
        for index, start, stop in _segments(group, group_of_slot[id(group)]):
            if index not in flat:
                continue
            segment = nn.Parameter(group.shard[start:stop], requires_grad=True)
            buckets[index].append(segment)
            segment_map.entries.append((segment, group, start, stop))
            segment_map.group_index[id(segment)] = index
    return segment_map, buckets


def _flat_optimizer(engine: Engine, optim_cls: type[torch.optim.Optimizer], options: list[dict],
                    group_of_slot: dict[int, list[int]], defaults: dict):
    """One elementwise class over flat segments: the fast path, stepped unit by unit."""
    segment_map, buckets = _flat_segments(engine, group_of_slot, len(options), set(range(len(options))))
    torch_groups = [dict(opts, params=params) for opts, params in zip(options, buckets)]
    # An empty group would make some optimizers fail; a rank whose shard holds only padding still
    # needs the same groups, so keep them and give them a zero-size segment.
    master_device = engine.trainable_groups[0].shard.device
    for torch_group in torch_groups:
        if not torch_group["params"]:
            torch_group["params"] = [nn.Parameter(torch.zeros(0, device=master_device))]
    opt = _sharded_class(optim_cls)(torch_groups, **defaults)
    state = opt.zeroshard_state = ShardedState(engine, segment_map)
    if engine.store is not None and engine.store.kind == "disk":
        max_numel = engine.options.offload.slice_numel
        state.sliced_step = SlicedStep(opt, engine.store, unhooked(optim_cls.step), max_numel)
    elif engine.store is None:
        state.pipeline = _UnitPipeline(engine, segment_map, len(torch_groups))

    def before_step(o, args, kwargs) -> None:
        if engine.store is not None:
            engine.finish_reductions()
            engine.wait_host_copies()

    opt.register_step_pre_hook(before_step)
    return opt


def _parts_optimizer(engine: Engine, optim_cls: type, options: list[dict], plans: list[tuple[type, OptimKind]],
                     group_of_slot: dict[int, list[int]], defaults: dict):
    """Several classes, or per-tensor ones: each part steps its own groups (zeroshard/runtime/optim_parts.py)."""
    per_tensor = {i for i, (_, kind) in enumerate(plans) if kind is OptimKind.PER_TENSOR}
    items = [(g, slot) for g in engine.trainable_groups for slot, index in enumerate(group_of_slot[id(g)])
             if index in per_tensor]
    _refuse_unsupported(engine, items)
    # Expert params (sharded over their expert mesh) stack the experts on dim 0: each expert's
    # matrix is the class's unit, owned with its stack inside the expert-data-parallel group.
    owned = [OwnedParam(g, slot, owner, group_of_slot[id(g)][slot],
                        experts=g.layout.slots[slot].shape[0] if g.mesh is not engine.mesh else 0)
             for (g, slot), owner in zip(items, assign_owners(items))]
    segment_map, buckets = _flat_segments(engine, group_of_slot, len(options), set(range(len(options))) - per_tensor)
    step = PerTensorStep(owned)
    for item in step.mine():
        assert item.param is not None, "an owner holds a whole param for each param it owns"
        buckets[item.torch_group].extend(item.units if item.experts else [item.param])
    device = engine.trainable_groups[0].shard.device
    for index in per_tensor:
        shapes = [shape for o in owned if o.torch_group == index
                  for shape in _unit_shapes(o.group.layout.slots[o.slot_index].shape, o.experts)]
        probe(plans[index][0], shapes, options[index] if plans[index][0] is not optim_cls else {**defaults,
                                                                                              **options[index]}, index)
        if not buckets[index]:  # a rank owning none of the group's params still needs the group
            buckets[index] = [nn.Parameter(torch.zeros([0] * len(shapes[0]) if shapes else [0], device=device))]
    for index, bucket in enumerate(buckets):
        if not bucket:
            bucket.append(nn.Parameter(torch.zeros(0, device=device)))
    torch_groups = [dict(opts, params=params) for opts, params in zip(options, buckets)]
    own = [torch_groups[i] for i, (cls, _) in enumerate(plans) if cls is optim_cls]
    if not own:
        raise ValueError(f"no param group uses {optim_cls.__name__}, the class zs.optimizer was called with; pass "
                         "the class of some group (e.g. AdamW) and name the others' classes in their groups")
    opt = _sharded_parts_class(optim_cls)(own, **defaults)
    parts = build_parts(opt, torch_groups, plans)
    step.release()
    opt.zeroshard_state = ShardedState(engine, segment_map, parts=parts, per_tensor=step)
    return opt


def _unit_shapes(shape: torch.Size, experts: int) -> list[torch.Size]:
    """The shapes the class steps for one param: the param's own, or each stacked expert's."""
    return [shape[1:]] * experts if experts else [shape]


def _refuse_unsupported(engine: Engine, items: list[tuple[FlatGroup, int]]) -> None:
    """What per-tensor owners do not compose with yet, refused by name before any state is built."""
    if not items:
        return
    if engine.store is not None and engine.store.kind == "disk":
        raise ValueError("a per-tensor optimizer cannot run with offload='disk' (its step is not sliced to "
                         "whole tensors); use offload='cpu', or an elementwise optimizer such as AdamW")


def _resolve_user_groups(engine: Engine, param_groups: list[dict] | None, defaults: dict):
    if param_groups is None:
        weight_decay = defaults.get("weight_decay", 0.0)
        return {}, [{"weight_decay": weight_decay}, {"weight_decay": 0.0}]
    by_id: dict[int | str, str] = {}  # id of a param (or an alias of it) -> its name
    for group in engine.groups:
        for ref in group.refs:
            by_id[ref.original_id] = ref.fqn
            for alias in ref.aliases:
                by_id[alias] = ref.fqn
    name_to_group, options = {}, []
    for index, spec in enumerate(param_groups):
        options.append({k: v for k, v in spec.items() if k != "params"})
        for item in spec["params"]:
            key = item if isinstance(item, str) else id(item)
            if key not in by_id:
                raise ValueError(f"param group {index} lists {item if isinstance(item, str) else 'a tensor'} "
                                 "that is not a param of the sharded model")
            fqn = by_id[key]
            if fqn in name_to_group:
                raise ValueError(f"param {fqn!r} appears in two param groups; list each param once")
            name_to_group[fqn] = index
    return name_to_group, options
