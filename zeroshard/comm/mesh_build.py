"""``ParallelDims.build``: the process groups of a layout, from one torch ``DeviceMesh``.

The DeviceMesh spans (pp, replicate, shard, tp) with the dims of one rank left out, except
``shard``, which every mesh has (a dim of the whole world is the default group itself, so a plain
data-parallel mesh creates no group at all). Its dims give the shard, replicate, tp and pp groups;
the two groups that are not one dim of it are built beside it: a stage's data-parallel group (its
ranks with one tp index) and the pp-ends group (a pp group's first and last rank, over which a tied
embedding/head grad is summed). With ``ep > 1`` the expert mesh is built after the dense groups.

``new_group`` is collective over the whole world, so every rank builds every group in the same
order and keeps its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zeroshard.comm.devices import local_rank_device
from zeroshard.comm.expert_mesh import build_expert_mesh
from zeroshard.comm.ledger import Ledger, process_ledger
from zeroshard.comm.mesh import Mesh

if TYPE_CHECKING:
    from zeroshard.comm.dims import ParallelDims
    from zeroshard.comm.topology import Topology


def device_for(backend: str) -> torch.device:
    return local_rank_device(backend)  # refuses more local ranks than GPUs on NCCL


def _device_type() -> str:
    return device_for(dist.get_backend()).type


def check_composed(dims: ParallelDims) -> None:
    """One line for a layout whose dims are valid but not built together yet (a planner asks too)."""
    if dims.ep > 1 and dims.pp > 1 and dims.tp > 1:
        raise ValueError(f"ep={dims.ep} with tp={dims.tp} under pp={dims.pp} is not composed yet; use tp=1 with pp "
                         "and ep, or pp=1")


def build_mesh(dims: ParallelDims, topology: Topology | None, *, name: str, ledger: Ledger | None,
               allow_cross_host: bool = False) -> Mesh:
    world, rank = dist.get_world_size(), dist.get_rank()
    if dims.world != world:
        raise ValueError(f"the layout {dims.describe()} covers {dims.world} ranks but the world has {world}; make "
                         "its degrees multiply to the world size")
    check_composed(dims)
    if topology is not None:  # before any group: a refused layout builds nothing
        topology.check_placement(dims.sizes(), allow_cross_host=allow_cross_host)
    groups = _dense_groups(dims, rank)
    ledger = ledger or process_ledger()
    device = device_for(dist.get_backend())
    experts = None
    if dims.ep > 1:  # after the dense groups, in the same order on every rank (new_group is collective)
        experts = build_expert_mesh(rank=rank, dims=dims, device=device, name=name, ledger=ledger, topology=topology)
    return Mesh(rank=rank, dims=dims, device=device, backend=dist.get_backend(), world_group=dist.group.WORLD,
                name=name, ledger=ledger, topology=topology, experts=experts, **groups)


def _dense_groups(dims: ParallelDims, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    kept = [(d, n) for d, n in (("pp", dims.pp), ("replicate", dims.replicate), ("shard", dims.shard), ("cp", dims.cp),
                                ("tp", dims.tp)) if n > 1 or d == "shard"]
    device_mesh = init_device_mesh(_device_type(), tuple(n for _, n in kept), mesh_dim_names=tuple(d for d, _ in kept))
    out = {"device_mesh": device_mesh, "shard_group": device_mesh.get_group("shard"),
           "replicate_group": device_mesh.get_group("replicate") if dims.replicate > 1 else None,
           "tp_group": device_mesh.get_group("tp") if dims.tp > 1 else None,
           "pp_group": device_mesh.get_group("pp") if dims.pp > 1 else None,
           "cp_group": device_mesh.get_group("cp") if dims.cp > 1 else None}
    if dims.cp > 1:  # ZeRO shards over shard x cp: a cp rank's grads sum like a data-parallel rank's
        out["shard_group"] = _own_group(dims.zero_groups(), rank)
    if dims.tp > 1 or dims.pp > 1:  # without either the data-parallel (x cp) ranks are the world
        out["dp_group"] = _own_group(dims.stage_dp_groups(), rank)
    if dims.pp > 1:
        out["pp_ends_group"] = _pp_ends_group(dims, rank, out["pp_group"])
    return out


def _own_group(rank_lists: list[list[int]], rank: int):
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _pp_ends_group(dims: ParallelDims, rank: int, pp_group):
    """The first and last rank of each pp group: the pp group itself when pp is 2."""
    if dims.pp == 2:
        return pp_group
    ends = [[inner, inner + (dims.pp - 1) * dims.stage_world] for inner in range(dims.stage_world)]
    mine = _own_group(ends, rank)
    return mine
