"""The mesh the expert params live on: ep ranks split the experts, the rest shard each expert.

``zs.init(ep=E)`` (and ``new_mesh(ep=E)``) builds one next to the dense mesh, as ``Mesh.experts``.
Ranks are laid out over the whole world with ``ep`` innermost: rank = edp_index * E + ep_index, so
an ep group is a run of E consecutive ranks (inside a node when E fits: its all-to-alls carry
activations on every MoE layer, forward and backward, on the critical path) and an
expert-data-parallel (edp) group is every E-th rank: the W / E ranks that hold the same experts.
Under tp the ep ranks are borrowed from dp × tp (the experts are not tensor parallel): with tp
innermost on the dense mesh too, an ep group is whole tp groups, or lies inside one.

For the engine this is a mesh like any other whose ``shard`` group is the edp group, with no
replicate group: a flat group of expert params is all-gathered and reduce-scattered over the
ranks that hold the same experts. What differs from a dense mesh is the gradient's divisor:
``dp_size`` is the dense mesh's data-parallel degree (the world without tp), because an expert's
grad, after the combine all-to-all's backward and the sum over edp, holds the contributions of
every data-parallel batch's tokens once, exactly as a dense param's grad after its reduction does
(under tp each rank of a tp group dispatches its own share of the group's one batch:
zeroshard/parallel/experts/layer.py). ``dp_name`` (the group holding identical values: init broadcast,
stage 0's all-reduce) is the edp group.

Under pipeline parallelism (``zs.init(pp=P, ep=E)``) each stage's experts live inside that stage's
ranks: the expert mesh of a rank is built over its stage's W / P consecutive ranks, which are its
world (``rank`` and ``world`` are stage-local, its world group is the stage's ranks), with ep runs
and edp strides inside it. The pp dim stays outermost and only activations cross stages.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zeroshard.comm.ledger import Ledger
from zeroshard.comm.mesh import Mesh
from zeroshard.comm.names import Group
from zeroshard.comm.topology import Topology

if TYPE_CHECKING:
    from zeroshard.comm.dims import ParallelDims


@dataclasses.dataclass(frozen=True)
class ExpertMesh(Mesh):
    """The expert params' parallel context: ``shard`` is expert data parallel, ``ep`` splits experts.

    ``dims`` is the dense mesh's own layout: its world is one stage's ranks, sharded over the
    ``dims.edp`` ranks that hold the same experts."""

    ep_group: object | None = dataclasses.field(default=None, repr=False)

    @property
    def world(self) -> int:
        return self.dims.stage_world

    @property
    def shard_size(self) -> int:
        return self.dims.edp

    @property
    def tp_size(self) -> int:
        return 1  # the experts are not tensor parallel

    @property
    def pp_size(self) -> int:
        return 1  # built inside one stage

    @property
    def stage_world(self) -> int:
        return self.world

    @property
    def dp_size(self) -> int:
        """The divisor of the averaged expert grad: the dense mesh's data-parallel batches its sum covers."""
        return self.dims.dp

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def ep_rank(self) -> int:
        """Which block of experts this rank holds: experts [ep_rank·E/ep, (ep_rank+1)·E/ep)."""
        return self.rank % self.ep_size

    @property
    def shard_rank(self) -> int:
        return self.rank // self.ep_size

    @property
    def replicate_size(self) -> int:
        # Every rank with this rank's experts is in its shard group: no replicas to all-reduce over.
        return 1

    @property
    def replicate_rank(self) -> int:
        return 0

    @property
    def tp_rank(self) -> int:
        return 0

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp_size

    @property
    def pp_rank(self) -> int:
        return 0

    @property
    def dp_name(self) -> Group:
        return Group.DP

    def __post_init__(self) -> None:
        super().__post_init__()
        # The ranks that hold the same values are the edp group; the dense data-parallel degree
        # (dp_size) is the divisor of the averaged grad, see the module docstring.
        self._sizes.update({Group.DP: self.shard_size, Group.EP: self.ep_size, Group.REPLICATE: 1})
        self._handles.update({Group.DP: self.shard_group, Group.EP: self.ep_group})

    def describe(self) -> dict:
        return {**super().describe(), "ep_size": self.ep_size, "edp_size": self.shard_size}


def expert_mesh_name(dense_name: str) -> str:
    """The ledger name of a dense mesh's expert mesh: ``experts`` for the default one."""
    return "experts" if dense_name == "default" else f"{dense_name}.experts"


def build_expert_mesh(*, rank: int, dims: ParallelDims, device: torch.device, name: str, ledger: Ledger,
                      topology: Topology | None) -> ExpertMesh:
    """The ep and edp groups of each pipeline stage's ranks (the whole world without pp): ep runs
    and edp strides inside it (collective: every rank builds every stage's groups, in the same
    order). Groups of one rank are real groups too, so ``group()`` never hands out None for a dim
    the engine communicates over."""
    ep_group, edp_group, stage_group = _stage_local_groups(dims, rank)
    return ExpertMesh(rank=rank % dims.stage_world, dims=dims, device=device, backend=dist.get_backend(),
                      world_group=stage_group, shard_group=edp_group, replicate_group=None, dp_group=edp_group,
                      name=expert_mesh_name(name), ledger=ledger, topology=topology if dims.pp == 1 else None,
                      ep_group=ep_group)


def _stage_local_groups(dims: ParallelDims, rank: int) -> tuple[object, object, object]:
    """This rank's ep run, edp stride and stage group (the world group itself without pp)."""
    stage_world, ep = dims.stage_world, dims.ep
    mine: tuple[object, object, object] = (None, None, None)
    for stage in range(dims.pp):
        base = stage * stage_world
        ranks = list(range(base, base + stage_world))
        runs = [ranks[i:i + ep] for i in range(0, stage_world, ep)]
        strides = [ranks[i::ep] for i in range(ep)]
        groups = [(r, dist.new_group(r)) for r in runs + strides]
        groups.append((ranks, dist.new_group(ranks) if dims.pp > 1 else dist.group.WORLD))
        if rank in ranks:
            mine = tuple(g for r, g in groups if rank in r)  # type: ignore[assignment]
    return mine
