"""Which params are expert params, and on which mesh: a mark the engine reads when it groups params.

``zs.expert_parallel`` replaces each MoE layer's stacked expert params by this rank's block of
experts and marks the new Parameters with their expert mesh. ``zs.shard`` then puts marked params
in flat groups of their own, on that mesh (``split_groups`` in zeroshard/runtime/grouping.py), so everything a flat
group does (gathers, reductions, the optimizer's shard, clipping) runs over the expert groups.
The mark lives on the Parameter object the user's model holds until ``zs.shard`` flattens it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.comm import collectives
from zeroshard.comm.expert_mesh import ExpertMesh
from zeroshard.comm.names import Group, Phase

_ATTR = "_zeroshard_expert_mesh"


def mark_expert(param: nn.Parameter, mesh: Any) -> None:
    """Place ``param`` (a stacked tensor of this rank's experts, experts on dim 0) on ``mesh``."""
    setattr(param, _ATTR, mesh)


def expert_mesh_of(param: nn.Parameter) -> Any | None:
    """The expert mesh ``param`` was placed on, or None for a dense param."""
    return getattr(param, _ATTR, None)


def all_experts(value: torch.Tensor, mesh: Any, *, unit: str = "") -> torch.Tensor:
    """The stacked value of every expert from this rank's block of them (a collective over ep):
    ep rank r holds experts [r·n, (r+1)·n), so the blocks gathered in rank order are the model's
    own tensor. A dense param (``mesh`` without ep) comes back as it is."""
    if not isinstance(mesh, ExpertMesh) or mesh.ep_size == 1:
        return value
    ep = mesh.ep_size
    block = value.detach().contiguous()
    whole = torch.empty((ep * block.shape[0],) + tuple(block.shape[1:]), dtype=block.dtype, device=block.device)
    collectives.all_gather(whole.view(-1), block.view(-1), group=Group.EP, unit=unit, phase=Phase.STATE_DICT,
                           mesh=mesh)
    return whole


def placement(mesh: Any) -> dict | None:
    """How a param on ``mesh`` is split over ep, as the checkpoint manifest records it: ep rank r
    holds rows [r·n, (r+1)·n) of dim 0 (n = rows / ep), each block ZeRO-sharded over the edp
    ranks. None for a dense param."""
    if not isinstance(mesh, ExpertMesh) or mesh.ep_size == 1:
        return None
    return split_over(mesh.ep_size, mesh.shard_size)


def split_over(ep: int, edp: int) -> dict:
    """The manifest's record of an expert param split over ``ep`` ranks, each block sharded over ``edp``."""
    return {"placement": "shard", "dim": 0, "ep": ep, "edp": edp}


def expert_rows(mesh: Any, local_shape: torch.Size) -> tuple[torch.Size, int]:
    """(the full tensor's shape, the element offset of this rank's block in it) for a param of
    ``local_shape`` on ``mesh``: an expert param holds rows [ep_rank·n, (ep_rank+1)·n) of dim 0 of
    the model's own tensor, a contiguous run. A dense param is its own whole (offset 0)."""
    if not isinstance(mesh, ExpertMesh) or mesh.ep_size == 1:
        return local_shape, 0
    rows = local_shape[0]
    row_numel = local_shape.numel() // rows if rows else 0
    return torch.Size((rows * mesh.ep_size, *local_shape[1:])), mesh.ep_rank * rows * row_numel
