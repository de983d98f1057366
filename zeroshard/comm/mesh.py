"""The named mesh: one layout's process groups, and the meshes this process has built.

``ParallelDims`` (zeroshard/comm/dims.py) holds the degrees and the rank arithmetic and builds the
mesh (``ParallelDims.build``); a mesh keeps that one object and reads every size from it. With
``tp > 1`` the torch DeviceMesh's "tp" sub-mesh is what ``parallelize_module`` takes
(zeroshard/runtime/tp.py). docs/tensor_parallel.md. ``zs.init`` and ``new_mesh`` live in
zeroshard/comm/world.py.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zeroshard.comm.ledger import Ledger, process_ledger
from zeroshard.comm.names import Dim, Group, group_of
from zeroshard.comm.topology import Topology

if TYPE_CHECKING:
    from zeroshard.comm.dims import ParallelDims


@dataclasses.dataclass(frozen=True)
class Mesh:
    """One parallel context: its layout (``dims``), this rank in it and the process groups built from it.

    ``zs.init`` builds the default one; ``new_mesh`` builds more on the same process group (experts
    on their own mesh, two pipeline stages on one rank, two models sharded differently). An engine
    is given its mesh and asks it, never a global, for its groups (``group``) and for the ledger
    its collectives are recorded in (``ledger``).
    """

    rank: int
    dims: ParallelDims
    """The layout: every size below is read from it (``mesh.dims[Dim.TP]`` too)."""
    device: torch.device
    backend: str
    world_group: object = dataclasses.field(repr=False)
    shard_group: object = dataclasses.field(repr=False)
    replicate_group: object | None = dataclasses.field(repr=False)
    pp_group: object | None = dataclasses.field(default=None, repr=False)
    """The ranks with this rank's (replicate, shard, tp) index, one per pipeline stage."""
    pp_ends_group: object | None = dataclasses.field(default=None, repr=False)
    """The first and last rank of this rank's pp group (tied embedding/head grads); None for a middle one."""
    tp_group: object | None = dataclasses.field(default=None, repr=False)
    dp_group: object | None = dataclasses.field(default=None, repr=False)
    """Every rank of this pp stage with this rank's tp index (replicate × shard × cp); the world when tp and pp are 1."""
    cp_group: object | None = dataclasses.field(default=None, repr=False)
    """The ranks this rank's sequences are split over (None without context parallelism)."""
    device_mesh: object | None = dataclasses.field(default=None, repr=False)
    """The torch DeviceMesh over the dims of more than one rank, and "shard" always."""
    name: str = "default"
    """Stamped on every ledger record of a mesh other than the default, so two meshes' "shard"
    groups stay apart in the ledger and the doctor."""
    ledger: Ledger = dataclasses.field(default_factory=process_ledger, repr=False, compare=False)
    """Where this mesh's collectives are recorded: the process ledger unless the caller gave one,
    so that one rank's collectives over every mesh stay one sequence for the watchdog and doctor."""
    topology: Topology | None = dataclasses.field(default=None, repr=False, compare=False)
    """Every rank's host and device facts, gathered at ``zs.init`` (zeroshard/comm/topology.py);
    None for a mesh built by hand, which counts as one host."""
    experts: Mesh | None = dataclasses.field(default=None, repr=False, compare=False)
    """With ``ep > 1``: the mesh the expert params live on (zeroshard/comm/expert_mesh.py), built
    with this one over the same ranks; None without expert parallelism."""
    _sizes: dict = dataclasses.field(init=False, repr=False, compare=False)
    _handles: dict = dataclasses.field(init=False, repr=False, compare=False)

    @property
    def world(self) -> int:
        return self.dims.world

    @property
    def shard_size(self) -> int:
        """Ranks ZeRO shards over: shard × cp."""
        return self.dims.zero_shard

    @property
    def cp_size(self) -> int:
        """Context-parallel degree: ranks one sequence is split over (1: every rank holds whole sequences)."""
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        return self.dims.coords(self.rank)[Dim.CP]

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def pp_size(self) -> int:
        """Pipeline stages (ranks per pp group); 1: every rank runs the whole model."""
        return self.dims.pp

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many ranks see different batches (world / tp / pp)."""
        return self.dims.dp

    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage (replicate × shard × tp): the world when pp is 1."""
        return self.dims.stage_world

    @property
    def pp_rank(self) -> int:
        """Which pipeline stage (rank of the pp group) this rank runs."""
        return self.dims.coords(self.rank)[Dim.PP]

    @property
    def replicate_size(self) -> int:
        return self.dims.replicate

    @property
    def ep_size(self) -> int:
        """Expert-parallel degree: how many ranks split each MoE layer's experts (1: every rank
        holds every expert). Not a factor of the world of its own: ep groups are runs of
        consecutive ranks borrowed from the data-parallel and tp ranks (docs/expert_parallel.md)."""
        return self.dims.ep

    @property
    def shard_rank(self) -> int:
        """This rank's index in its ZeRO group (shard × cp)."""
        return self.dims.zero_rank(self.rank)

    @property
    def replicate_rank(self) -> int:
        return self.dims.coords(self.rank)[Dim.REPLICATE]

    @property
    def tp_rank(self) -> int:
        return self.dims.coords(self.rank)[Dim.TP]

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def dp_name(self) -> Group:
        """The group spanning the data-parallel ranks: the world without TP or PP, else ``dp``."""
        return self.dims.dp_name

    def __post_init__(self) -> None:
        # Asked for on every collective: one dict lookup, keyed by the enum and by its text alike.
        sizes = {Group.WORLD: self.world, Group.SHARD: self.shard_size, Group.REPLICATE: self.replicate_size,
                 Group.TP: self.tp_size, Group.DP: self.dims.grad_dp, Group.PP: self.pp_size,
                 Group.PP_ENDS: min(self.pp_size, 2), Group.EP: self.ep_size, Group.CP: self.cp_size}
        object.__setattr__(self, "_sizes", sizes)
        # tp/pp/ep are None when one rank each: their group_size of 1 keeps callers from using them.
        # Without tp, the data-parallel ranks are the world.
        handles = {Group.WORLD: self.world_group, Group.SHARD: self.shard_group,
                   Group.REPLICATE: self.replicate_group, Group.TP: self.tp_group,
                   Group.DP: self.dp_group or self.world_group, Group.PP: self.pp_group,
                   Group.PP_ENDS: self.pp_ends_group, Group.CP: self.cp_group,
                   Group.EP: self.experts.group(Group.EP) if self.experts is not None else None}
        object.__setattr__(self, "_handles", handles)

    @property
    def placement(self) -> Topology:
        """Where the ranks run: the gathered topology, or one host for a mesh built by hand."""
        return self.topology if self.topology is not None else Topology.from_hosts(["localhost"] * self.world)

    @property
    def inside_host(self) -> dict[Dim, bool]:
        """For each dim, whether its groups stay inside one host."""
        return self.placement.inside_host(self.dims.sizes())

    def topology_summary(self) -> dict:
        """Hosts x ranks, each rank's host, which dims stay inside a host and each host's facts: what
        the summary, summary.json and metrics.jsonl's header record."""
        return self.placement.describe(self.dims.sizes())

    def group_size(self, group: str | Group) -> int:
        size = self._sizes.get(group)  # a Group hashes and compares as its text, so "shard" finds it too
        return size if size is not None else self._sizes[group_of(group)]

    def group(self, group: str | Group):
        """The process group of ``group`` that holds this rank (None for a one-rank tp, pp or ep)."""
        if group == Group.REPLICATE and self.replicate_group is None:
            raise RuntimeError("no replicate group: the mesh has replicate size 1")
        handles = self._handles
        return handles[group] if group in handles else handles[group_of(group)]

    @property
    def ledger_name(self) -> str:
        """What the ledger records as this mesh: empty for the default mesh, so its records read as before."""
        return "" if self.name == "default" else self.name

    @property
    def tp_mesh(self):
        """The 1-D "tp" DeviceMesh that ``parallelize_module`` takes."""
        if self.tp_size == 1 or self.device_mesh is None:
            raise RuntimeError("this mesh has no tp dim: call zs.init(tp=N) with N > 1 to use tensor parallelism")
        return self.device_mesh["tp"]  # type: ignore[index]

    def describe(self) -> dict:
        return {
            "world": self.world,
            "shard_size": self.shard_size,
            "replicate_size": self.replicate_size,
            "tp_size": self.tp_size,
            **({"ep_size": self.ep_size} if self.ep_size > 1 else {}),
            **({"pp_size": self.pp_size} if self.pp_size > 1 else {}),  # unchanged for a mesh without pp
            **({"cp_size": self.cp_size} if self.cp_size > 1 else {}),
            "backend": self.backend,
            "device": str(self.device),
        }


_MESH: Mesh | None = None
_OTHER_MESHES: list[Mesh] = []  # what new_mesh built since init, for lookups by process group


_ON_SHUTDOWN: list = []  # callables to run at shutdown, newest first


def on_shutdown(callback) -> None:
    """Run ``callback`` once when the process group is torn down (``shutdown``): for state that
    lives as long as the meshes, such as the DTensor ledger's dispatch mode."""
    _ON_SHUTDOWN.append(callback)


def all_meshes() -> list[Mesh]:
    """The default mesh, then every mesh ``new_mesh`` built since, in order."""
    return ([_MESH] if _MESH is not None else []) + _OTHER_MESHES


def current_mesh() -> Mesh | None:
    """The default mesh, or None before ``zs.init``."""
    return _MESH


def register(mesh: Mesh, *, default: bool) -> Mesh:
    """Record a mesh ``zs.init`` (``default``) or ``new_mesh`` built, for ``get_mesh`` and lookups."""
    global _MESH
    if default:
        _MESH = mesh
    else:
        _OTHER_MESHES.append(mesh)
    return mesh


def get_mesh() -> Mesh:
    if _MESH is None:
        raise RuntimeError("zeroshard is not initialised: call zs.init() first (every rank)")
    return _MESH


def shutdown() -> None:
    """Tear down the process group so a process can exit (or re-init) cleanly."""
    global _MESH
    while _ON_SHUTDOWN:
        _ON_SHUTDOWN.pop()()
    _MESH = None
    _OTHER_MESHES.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
