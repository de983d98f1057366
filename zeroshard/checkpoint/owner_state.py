"""Optimizer state of params stepped whole on their owners (zeroshard/runtime/owners.py), as the
checkpoint's usual pieces.

A checkpoint stores each param's state as element ranges of the flattened param, written by
whichever rank writes those elements' master (``writer_range``), so that any world, stage or
layout reads it back by range. An owner holds its params' state whole; at save it sends each rank
the ranges that rank's shard holds (the owner exchange's pattern), and at load every rank reads its
ranges and sends them to the param's owner in the new layout, which may be another rank. So a
Muon checkpoint saved at world 4 stage 3 resumes at world 2 stage 2. State that is not one value
per element (Adafactor's factored row and column moments) has no element ranges: refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.pieces import saved_extent
from zeroshard.comm import collectives
from zeroshard.comm.names import Group, Phase
from zeroshard.runtime.optim import sharded_state
from zeroshard.runtime.owners import OwnedParam, PerTensorStep, held_range, to_holders, to_owners, tp_part, tp_whole


def _step_of(optimizer) -> PerTensorStep | None:
    state = sharded_state(optimizer) if optimizer is not None else None
    return state.per_tensor if state is not None else None


@dataclasses.dataclass
class OwnerPieces:
    """This rank's pieces of owner state: per (group, slot) the state names and the tensors over
    the elements its shard holds (``held_range``), and the owners' scalar state per torch group."""

    by_slot: dict[tuple[int, int], tuple[OwnedParam, list[str], list[torch.Tensor]]]
    scalars: dict[int, dict[str, Any]]

    def lookup(self, group, slot_index: int):
        return self.by_slot.get((id(group), slot_index))


def _refuse_stacked_experts(step: PerTensorStep) -> None:
    """Per-expert state is keyed by each expert's unit, not by the stacked param a checkpoint names."""
    stacked = next((o for o in step.owned if o.experts), None)
    if stacked is not None:
        raise CheckpointError(f"{stacked.group.layout.slots[stacked.slot_index].fqn!r} is a stacked expert param "
                              "stepped per expert by a per-tensor optimizer, whose state cannot be checkpointed yet; "
                              "save without the optimizer (optimizer=None) or put expert params in an AdamW group")


def spread(optimizer, engine) -> OwnerPieces | None:
    """Collective over the shard group: the owners' state cut into the pieces each rank writes."""
    step = _step_of(optimizer)
    if step is None:
        return None
    _refuse_stacked_experts(step)
    local: dict[int, list[str]] = {}
    problem = None
    for i, item in enumerate(step.owned):
        if not item.mine:
            continue
        state = optimizer.state.get(item.param, {})
        local[i] = sorted(n for n, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
        for n in local[i]:
            if state[n].numel() != item.whole_shape.numel():
                problem = (f"optimizer state {n!r} of {item.group.layout.slots[item.slot_index].fqn!r} has "
                           f"{state[n].numel()} elements for a param of {item.numel}: only state with one value per "
                           "element (Muon's momentum, LAMB's moments) can be checkpointed per element; save the "
                           "model without the optimizer (optimizer=None) or use Muon or AdamW")
    gathered = collectives.all_gather_object((local, problem), group=Group.SHARD, phase=Phase.CHECKPOINT,
                                             mesh=engine.mesh)
    problem = next((p for _, p in gathered if p), None)
    if problem:
        raise CheckpointError(problem)
    names: dict[int, list[str]] = {}
    for part, _ in gathered:
        names.update(part)
    index_of = {id(item): i for i, item in enumerate(step.owned)}

    def count(item: OwnedParam) -> int:
        return len(names.get(index_of[id(item)], []))

    pieces: dict[int, list[torch.Tensor]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    for exchange in step.exchanges:
        whole = {}
        for item in exchange.owned:
            state = optimizer.state.get(item.param, {})
            # A tp-split param's state is whole across tp on each tp rank's owner: each saves its part.
            whole[id(item)] = [tp_part(state[n].detach(), item).reshape(-1).to(exchange.group.shard.dtype)
                               for n in names.get(index_of[id(item)], [])]
            scalars.setdefault(item.torch_group, {}).update(
                {n: v for n, v in state.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)})
        pieces.update(to_holders(exchange, whole, count))
    by_slot = {(id(item.group), item.slot_index): (item, names.get(index_of[id(item)], []), pieces.get(id(item), []))
               for item in step.owned}
    return OwnerPieces(by_slot, scalars)


@dataclasses.dataclass
class OwnerReads:
    """What a load reads for owned params on this rank, until the owners gather it."""

    step: PerTensorStep
    names: dict[int, list[str]]  # id(item) -> saved state names
    pieces: dict[int, list[torch.Tensor]]  # id(item) -> tensors over this rank's held range


def plan_reads(plan, optimizer) -> OwnerReads | None:
    """Queue the reads of this rank's pieces of every owned param's state (``plan``: a load Plan)."""
    step = _step_of(optimizer)
    if step is None:
        return None
    _refuse_stacked_experts(step)
    reads = OwnerReads(step, {}, {})
    for item in step.owned:
        group, index = item.group, item.slot_index
        param = plan.param_of(group, index)
        if param["param_group"] not in (None, item.torch_group):
            raise CheckpointError(f"param {param['fqn']!r} was in optimizer param group {param['param_group']} "
                                  f"when saved and is in group {item.torch_group} now")
        reads.names[id(item)] = names = list(param["state"])
        a, b = held_range(item)
        tensors = [torch.empty(b - a, dtype=group.shard.dtype, device=group.shard.device) for _ in names]
        reads.pieces[id(item)] = tensors
        for n, t in zip(names, tensors):
            plan.read(param, f"optim.{n}", a + saved_extent(group, index)[1], t)
    return reads


def gather_owned(optimizer, reads: OwnerReads, saved_groups: list[dict]) -> None:
    """Collective: join the read pieces on each param's owner and install them as its state."""

    def count(item: OwnedParam) -> int:
        return len(reads.names[id(item)])

    for exchange in reads.step.exchanges:
        whole = to_owners(exchange, reads.pieces, count)
        for item in exchange.owned:
            names = reads.names[id(item)]
            if not names:
                continue
            assert item.param is not None
            shape = exchange.group.layout.slots[item.slot_index].shape
            state: dict[str, Any] = {n: tp_whole(t.view(shape), item) for n, t in zip(names, whole[id(item)])}
            for n, value in saved_groups[item.torch_group]["scalars"].items():
                value = fmt.from_json(value)
                state[n] = value.to(item.param.device) if isinstance(value, torch.Tensor) and \
                    value.device != item.param.device and _on_device(optimizer, item) else value
            optimizer.state[item.param] = state


def _on_device(optimizer, item: OwnedParam) -> bool:
    group = optimizer.param_groups[item.torch_group]
    return bool(group.get("capturable") or group.get("fused"))
