"""Full (gathered) views of a sharded model's state."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from zeroshard.comm import collectives
from zeroshard.comm.names import Group, Phase
from zeroshard.runtime.expert_placement import all_experts
from zeroshard.runtime.engine import get_engine
from zeroshard.runtime import tp
from zeroshard.runtime.flat import FlatGroup


def gathered_master(group: FlatGroup, phase: Phase = Phase.STATE_DICT) -> torch.Tensor:
    """The group's whole flat master buffer, on the mesh's device (a collective over its shard
    group). Offloaded masters live on the host, which NCCL does not take: they travel through the
    device, one group at a time; on a CPU mesh nothing moves."""
    device = group.mesh.device
    if group.shards == 1:
        return group.shard.to(device)
    whole = torch.empty(group.layout.numel, dtype=group.shard.dtype, device=device)
    collectives.all_gather(whole, group.shard.to(device).contiguous(), group=Group.SHARD, unit=group.unit,
                           phase=phase, mesh=group.mesh)
    return whole


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every param at full size in its master dtype, under every name it is registered as, plus
    persistent buffers, in the order ``model.state_dict()`` lists them (not the flat buffers' order).
    A collective: call it on every rank. Costs one full copy of the model per rank."""
    engine = get_engine(model)
    params: dict[str, torch.Tensor] = {}
    for group in engine.groups:
        whole = gathered_master(group)
        for slot, ref, spec in zip(group.layout.slots, group.refs, group.tp_specs):
            # A tensor-parallel param is gathered over tp too, into the model's own layout.
            value = tp.full_value(whole[slot.offset:slot.end].view(slot.shape), spec, unit=group.unit,
                                  mesh=group.mesh).detach()
            value = all_experts(value, group.mesh, unit=group.unit)  # an expert param: every ep rank's block
            # A copy where the masters live: offloaded ones stay off the device (a whole model's worth).
            value = value.to(group.shard.device, copy=True)
            for alias in ref.aliases:
                params[alias] = value
    out: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, _ in module.named_parameters(recurse=False, remove_duplicate=False):
            if prefix + name in params:
                out[prefix + name] = params.pop(prefix + name)
        for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
            # As nn.Module.state_dict does: a non-persistent buffer (an HF model's rotary inv_freq)
            # is derived, not state, so a plain model's state_dict() and this compare key for key.
            if name not in module._non_persistent_buffers_set:  # noqa: SLF001 (no public API)
                out[prefix + name] = buffer.detach().clone()
    out.update(params)  # a name the module walk does not reach stays, after the rest
    return out


@contextlib.contextmanager
def unsharded(model: nn.Module):
    """Inside the block every unit is gathered and the modules show full params (stage 3)."""
    engine = get_engine(model)
    for unit in engine.units:
        unit.unshard("summon")
    for unit in engine.units:
        unit.wait_unshard()
    try:
        yield model
    finally:
        if engine.policy.shard_params:
            for unit in engine.units:
                unit.reshard()
