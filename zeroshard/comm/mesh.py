"""The process group and the named mesh: pp (pipeline) × replicate × shard (data parallel) × tp (tensor parallel).

Ranks are laid out pp-major with ``tp`` innermost:
rank = ((pp_index * replicate + replicate_index) * shard_size + shard_index) * tp + tp_index.
A pipeline stage's ranks are therefore consecutive, so its ZeRO and TP groups stay inside a node and
only the stage-to-stage sends cross nodes (docs/pipeline.md). So a TP group is a run of
consecutive ranks and, without TP, a shard group is too. Under torchrun consecutive ranks share a
node: TP's per-layer all-reduces (on the critical path) stay on the fastest links, then ZeRO's
all-gather / reduce-scatter, and only the all-reduce of already-reduced shards crosses replicas.
With ``tp > 1`` the mesh is a torch ``DeviceMesh`` named ("replicate", "shard", "tp"), whose "tp"
sub-mesh is what ``parallelize_module`` takes (zeroshard/sharding/tp.py). docs/tensor_parallel.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from zeroshard.comm.ledger import Ledger, process_ledger
from zeroshard.comm.names import Dim, Group, group_of
from zeroshard.comm.topology import Topology, UnevenHostsError


@dataclasses.dataclass(frozen=True)
class Mesh:
    """One parallel context: the ranks it spans, its dims and the process groups built from them.

    ``zs.init`` builds the default one; ``new_mesh`` builds more on the same process group (experts
    on their own mesh, two pipeline stages on one rank, two models sharded differently). An engine
    is given its mesh and asks it, never a global, for its groups (``group``) and for the ledger
    its collectives are recorded in (``ledger``).
    """

    rank: int
    world: int
    shard_size: int
    device: torch.device
    backend: str
    world_group: object = dataclasses.field(repr=False)
    shard_group: object = dataclasses.field(repr=False)
    replicate_group: object | None = dataclasses.field(repr=False)
    tp_size: int = 1
    pp_size: int = 1
    """Pipeline stages (ranks per pp group); 1: every rank runs the whole model."""
    pp_group: object | None = dataclasses.field(default=None, repr=False)
    """The ranks with this rank's (replicate, shard, tp) index, one per pipeline stage."""
    pp_ends_group: object | None = dataclasses.field(default=None, repr=False)
    """The first and last rank of this rank's pp group (tied embedding/head grads); None for a middle one."""
    tp_group: object | None = dataclasses.field(default=None, repr=False)
    dp_group: object | None = dataclasses.field(default=None, repr=False)
    """Every rank of this pp stage with this rank's tp index (replicate × shard); the world when tp and pp are 1."""
    device_mesh: object | None = dataclasses.field(default=None, repr=False)
    """The torch DeviceMesh ("replicate", "shard", "tp") when tp > 1."""
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
    def dp_size(self) -> int:
        """Data-parallel degree: how many ranks see different batches (world / tp / pp)."""
        return self.world // self.tp_size // self.pp_size

    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage (replicate × shard × tp): the world when pp is 1."""
        return self.world // self.pp_size

    @property
    def pp_rank(self) -> int:
        """Which pipeline stage (rank of the pp group) this rank runs."""
        return self.rank // self.stage_world

    @property
    def replicate_size(self) -> int:
        return self.dp_size // self.shard_size

    @property
    def ep_size(self) -> int:
        """Expert-parallel degree: how many ranks split each MoE layer's experts (1: every rank
        holds every expert). Not a factor of the world of its own: ep groups are runs of
        consecutive ranks borrowed from the data-parallel and tp ranks (docs/expert_parallel.md)."""
        return self.experts.ep_size if self.experts is not None else 1

    @property
    def shard_rank(self) -> int:
        return (self.rank // self.tp_size) % self.shard_size

    @property
    def replicate_rank(self) -> int:
        return (self.rank // (self.shard_size * self.tp_size)) % self.replicate_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.dp_size

    @property
    def dp_name(self) -> Group:
        """The group spanning the data-parallel ranks: the world without TP or PP, else ``dp``."""
        return Group.WORLD if self.tp_size == 1 and self.pp_size == 1 else Group.DP

    @property
    def dims(self) -> dict[Dim, int]:
        """Every mesh dim's size, outermost first; 1 for a dim this mesh does not use."""
        return {Dim.PP: self.pp_size, Dim.REPLICATE: self.replicate_size, Dim.SHARD: self.shard_size,
                Dim.TP: self.tp_size, Dim.EP: self.ep_size}

    def __post_init__(self) -> None:
        # Asked for on every collective: one dict lookup, keyed by the enum and by its text alike.
        sizes = {Group.WORLD: self.world, Group.SHARD: self.shard_size, Group.REPLICATE: self.replicate_size,
                 Group.TP: self.tp_size, Group.DP: self.dp_size, Group.PP: self.pp_size,
                 Group.PP_ENDS: min(self.pp_size, 2), Group.EP: self.ep_size}
        object.__setattr__(self, "_sizes", sizes)
        # tp/pp/ep are None when one rank each: their group_size of 1 keeps callers from using them.
        # Without tp, the data-parallel ranks are the world.
        handles = {Group.WORLD: self.world_group, Group.SHARD: self.shard_group,
                   Group.REPLICATE: self.replicate_group, Group.TP: self.tp_group,
                   Group.DP: self.dp_group or self.world_group, Group.PP: self.pp_group,
                   Group.PP_ENDS: self.pp_ends_group,
                   Group.EP: self.experts.group(Group.EP) if self.experts is not None else None}
        object.__setattr__(self, "_handles", handles)

    @property
    def placement(self) -> Topology:
        """Where the ranks run: the gathered topology, or one host for a mesh built by hand."""
        return self.topology if self.topology is not None else Topology.from_hosts(["localhost"] * self.world)

    @property
    def inside_host(self) -> dict[Dim, bool]:
        """For each dim, whether its groups stay inside one host."""
        return self.placement.inside_host(self.dims)

    def topology_summary(self) -> dict:
        """Hosts x ranks, each rank's host, which dims stay inside a host and each host's facts: what
        the summary, summary.json and metrics.jsonl's header record."""
        return self.placement.describe(self.dims)

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
        if self.device_mesh is None:
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


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


_BACKEND_DEVICES: dict[str, str] = {}
"""Backends whose groups run on a device other than the usual one (nccl: cuda, else cpu), as
``declare_backend_device`` set them."""


def declare_backend_device(backend: str, device_type: str) -> None:
    """Say that groups of ``backend`` run on ``device_type`` (device index 0): the mesh's ``device``,
    which every collective's tensors must be on (zeroshard/comm/collectives.py). For a backend that
    holds no device of its own, such as torch's fake process group in the fake-GPU tests."""
    _BACKEND_DEVICES[backend] = device_type


def _device_for(backend: str) -> torch.device:
    if backend in _BACKEND_DEVICES:
        return torch.device(_BACKEND_DEVICES[backend], 0)
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _resolve_shard_size(shard_size: int | str | None, world: int) -> int:
    """None: shard over the whole world. "node": one shard group per node, from torchrun's
    LOCAL_WORLD_SIZE, so all-gathers and reduce-scatters stay on intra-node links."""
    if shard_size is None:
        return world
    if shard_size == "node":
        return int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not isinstance(shard_size, int):
        raise ValueError(f"shard_size must be an int, 'node' or None, got {shard_size!r}")
    return shard_size


MESH_DIMS = ("replicate", "shard", "tp")
"""Mesh dim names, outermost first; ``tp`` is innermost (consecutive ranks)."""


SHAPE_DIMS = ("pp", "replicate", "shard", "ep", "tp")
"""The names ``mesh_shape`` may use, outermost first. ``pp`` is outside the data-parallel dims (a
stage's ranks are consecutive). ``ep`` is carved out of the data-parallel ranks (torchtitan's
dp_shard_in_ep): with ``names=("shard", "ep")`` the dense params are sharded over shard × ep ranks
and each expert's params over the ``shard`` ranks that hold it."""


def _from_mesh_shape(mesh_shape, names, world: int) -> tuple[int | None, int]:
    """(shard_size, tp) from a named shape such as ``mesh_shape=(2, 2), names=("shard", "tp")``; an
    ``ep`` entry is part of the dense shard size (``_ep_of_shape`` reads it)."""
    shard, tp, _ = _dims_of_shape(mesh_shape, names, world)
    return shard, tp


def _dims_of_shape(mesh_shape, names, world: int) -> tuple[int, int, int]:
    """(shard_size, tp, pp) from a named shape; the product must be the world."""
    shape, names = tuple(mesh_shape), tuple(names or MESH_DIMS[-len(tuple(mesh_shape)):])
    if len(shape) != len(names) or len(set(names)) != len(names) or \
            [n for n in SHAPE_DIMS if n in names] != list(names):
        raise ValueError(f"names {names} must be distinct dims out of {SHAPE_DIMS}, in that order, one per entry of "
                         f"mesh_shape {shape}")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in shape):
        raise ValueError(f"mesh_shape {shape} must hold positive ints")
    product = 1
    for n in shape:
        product *= n
    if product != world:
        raise ValueError(f"mesh_shape {shape} covers {product} ranks but the world has {world}; make the product "
                         f"of mesh_shape equal the world size (WORLD_SIZE / --nproc)")
    dims = dict(zip(names, shape))
    tp, ep, pp = dims.get("tp", 1), dims.get("ep", 1), dims.get("pp", 1)
    shard = dims.get("shard", world // tp // ep // pp // dims.get("replicate", 1)) * ep
    return shard, tp, pp


def _ep_of_shape(mesh_shape, names) -> int:
    """The ``ep`` entry of a named shape ``_from_mesh_shape`` accepted (1 without one)."""
    names = tuple(names or MESH_DIMS[-len(tuple(mesh_shape)):])
    return dict(zip(names, tuple(mesh_shape))).get("ep", 1)


def _check_existing_shape(mesh: Mesh, tp: int, mesh_shape, names, ep: int = 1, pp: int = 1) -> None:
    """A second ``init`` that names a tensor-, expert- or pipeline-parallel shape must ask for the
    mesh that exists: returning another one silently would run a different layout than the caller wrote."""
    if mesh_shape is not None:
        _, tp, pp = _dims_of_shape(mesh_shape, names, mesh.world)  # a shape that misses the world: its own error
        ep = _ep_of_shape(mesh_shape, names)
    for dim, asked, has in (("tp", tp, mesh.tp_size), ("ep", ep, mesh.ep_size), ("pp", pp, mesh.pp_size)):
        if asked != has:
            raise ValueError(f"the mesh already exists with {dim}={has}; call zs.shutdown() before zs.init() "
                             f"with {dim}={asked}")


def init(*, backend: str | None = None, shard_size: int | str | None = None, tp: int = 1, pp: int = 1,
         mesh_shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None,
         timeout_s: float = 600.0, allow_cross_host: bool = False, ep: int = 1) -> Mesh:
    """Join (or create) the default process group from the environment and build the mesh.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as torchrun and our launcher set them. With
    no RANK in the environment it starts a one-process world, so library code runs unchanged in a
    plain ``python`` session. Calling it again returns the existing mesh.

    ``shard_size=k`` makes a hybrid mesh of replicas × k shards (ZeRO stages 1-3 shard inside a
    group of k ranks and all-reduce across replicas); ``"node"`` takes k from the ranks per host the
    topology gather found.
    ``tp=t`` adds an innermost tensor-parallel dim of t consecutive ranks: the data-parallel ranks
    (replicate × shard) are then world / t. ``mesh_shape=(2, 2), names=("shard", "tp")`` says the
    same by name; the product must be the world size. See docs/tensor_parallel.md.
    ``ep=e`` splits every MoE layer's experts over runs of e consecutive data-parallel ranks and
    builds ``Mesh.experts``, the mesh the expert params are sharded over (docs/expert_parallel.md).
    ``pp=p`` adds an outermost pipeline dim: p stages of world / p consecutive ranks each, ZeRO
    (and tp) inside every stage (``names=("pp", "shard")`` by name). See docs/pipeline.md.

    Every rank's host and device facts are gathered first (``Mesh.topology``). Hosts with different
    numbers of ranks, and a tp group spanning hosts, are refused before any group is built; pass
    ``allow_cross_host=True`` to run tp across hosts anyway. See docs/topology.md.
    """
    global _MESH
    if _MESH is not None:
        if mesh_shape is not None or tp != 1 or ep != 1 or pp != 1:
            _check_existing_shape(_MESH, tp, mesh_shape, names, ep, pp)
        return _MESH
    backend = backend or default_backend()
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            # Via our helper: after a torchrun restart the env:// store still holds the dead
            # attempt's keys (see zeroshard/elastic.py).
            from zeroshard.elastic import init_process_group_from_env

            init_process_group_from_env(backend, timeout)
        else:
            # An in-memory store, not env vars: a plain process must not look like a torchrun
            # worker to the subprocesses it starts.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    topology = _join_topology()
    _MESH = _build_mesh(shard_size=shard_size, tp=tp, pp=pp, mesh_shape=mesh_shape, names=names, name="default",
                        ledger=None, topology=topology, allow_cross_host=allow_cross_host, ep=ep)
    return _MESH


_TOPOLOGY_GATHER: list = []
"""The collective that gathers every rank's facts (zeroshard/comm/topology_gather.py). It is handed
to this module by zeroshard/comm/__init__.py, because importing it here would be circular: the
collectives take a Mesh."""


def use_topology_gather(gather) -> None:
    """Make ``gather(world_mesh) -> Topology`` the topology collective ``init`` runs."""
    _TOPOLOGY_GATHER[:] = [gather]


def _world_mesh() -> Mesh:
    """A mesh of the world group alone: what the topology gather runs on before any group exists."""
    return Mesh(rank=dist.get_rank(), world=dist.get_world_size(), shard_size=dist.get_world_size(),
                device=_device_for(dist.get_backend()), backend=dist.get_backend(), world_group=dist.group.WORLD,
                shard_group=dist.group.WORLD, replicate_group=None)


def _join_topology() -> Topology:
    """Every rank's facts, checked before any group is built: a torchrun host whose local world does
    not divide the world is refused before the gather, uneven hosts right after it (every rank sees
    the same list, so every rank raises the same error instead of some hanging in a later group)."""
    world, local = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local and world % local:
        raise UnevenHostsError(f"ranks per host differ: this host runs {local} of the world's {world} ranks, which "
                               "is not an equal share; start the same number of ranks on every host "
                               "(torchrun --nproc-per-node N on each)")
    if not _TOPOLOGY_GATHER:
        return Topology.from_hosts(["localhost"] * world)
    topology = _TOPOLOGY_GATHER[0](_world_mesh())
    topology.check_even()
    return topology


def new_mesh(*, shard_size: int | str | None = None, tp: int = 1, pp: int = 1, mesh_shape: tuple[int, ...] | None = None,
             names: tuple[str, ...] | None = None, name: str, ledger: Ledger | None = None,
             allow_cross_host: bool = False, ep: int = 1) -> Mesh:
    """Another parallel context over the process group ``zs.init`` joined, next to the default one.

    Pass it to ``zs.shard(model, mesh=...)``: that model's collectives then run on this mesh's
    groups, so two models sharded over different layouts train in one process. It takes the
    layout arguments of ``init``. ``name`` labels its ledger records (``"experts"``, ``"stage1"``);
    ``ledger`` gives it a ledger of its own instead of the process's. Like ``init`` it is
    collective: every rank builds the same meshes in the same order.
    """
    if _MESH is None:
        raise RuntimeError("zs.new_mesh needs the process group: call zs.init() first (every rank)")
    if not isinstance(name, str) or not name or name == "default":
        raise ValueError(f"new_mesh needs a name of its own for the ledger (such as 'experts'), got {name!r}")
    if any(m.name == name for m in _OTHER_MESHES):
        raise ValueError(f"a mesh named {name!r} exists already; give each zs.new_mesh its own name")
    mesh = _build_mesh(shard_size=shard_size, tp=tp, pp=pp, mesh_shape=mesh_shape, names=names, name=name,
                       ledger=ledger, topology=_MESH.topology, allow_cross_host=allow_cross_host, ep=ep)
    _OTHER_MESHES.append(mesh)
    return mesh


def _build_mesh(*, shard_size, tp, mesh_shape, names, name: str, ledger: Ledger | None,
                topology: Topology | None = None, allow_cross_host: bool = False, ep: int = 1,
                pp: int = 1) -> Mesh:
    world, rank = dist.get_world_size(), dist.get_rank()
    if mesh_shape is not None:
        if shard_size is not None or tp != 1 or ep != 1 or pp != 1:
            raise ValueError("pass either mesh_shape/names or shard_size/tp/ep/pp, not both")
        shard_size, tp, pp = _dims_of_shape(mesh_shape, names, world)
        ep = _ep_of_shape(mesh_shape, names)
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or world % pp != 0:
        raise ValueError(f"pp={pp!r} does not divide world size {world}; pick a divisor of {world} (pp=1 is no "
                         "pipeline parallelism)")
    stage_world = world // pp
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or stage_world % tp != 0:
        where = f"world size {world}" if pp == 1 else f"the {stage_world} ranks of a pipeline stage (world {world} / pp {pp})"
        raise ValueError(f"tp={tp!r} does not divide {where}; pick a divisor of {stage_world} (tp=1 is no "
                         "tensor parallelism)")
    dp = stage_world // tp
    if shard_size == "node" and topology is not None and topology.uneven_error() is None:
        # The hosts the ranks reported, not LOCAL_WORLD_SIZE: a launcher may not set it, and one
        # that runs several "hosts" on a machine (ZEROSHARD_HOST) sets it to the machine's count.
        shard_size = max(1, topology.ranks_per_host // tp)
    if shard_size == "node" and tp > 1:  # a node's ranks hold tp-groups of tp ranks each
        shard_size = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)) // tp)
    shard_size = _resolve_shard_size(shard_size, dp)
    if shard_size < 1 or dp % shard_size != 0:
        raise ValueError(
            f"shard_size={shard_size} does not divide the {dp} data-parallel ranks (world {world} / tp {tp}"
            f"{f' / pp {pp}' if pp > 1 else ''}); pick "
            f"a divisor of {dp} (shard_size == {dp} is plain full sharding)"
        )
    if ep != 1:
        check_ep_layout(ep, dp, tp)
        if pp > 1 and tp > 1:
            raise ValueError(f"ep={ep} with tp={tp} under pp={pp} is not composed yet; use tp=1 with pp and ep, or pp=1")
    if topology is not None:  # before any group: a refused layout builds nothing
        topology.check_placement({Dim.PP: pp, Dim.REPLICATE: dp // shard_size, Dim.SHARD: shard_size, Dim.TP: tp,
                                  Dim.EP: ep},
                                 allow_cross_host=allow_cross_host)
    groups: dict = {}
    if pp > 1:
        groups = _build_pp_mesh(world, rank, pp, shard_size, tp)
        shard_group, replicate_group = groups.pop("shard_group"), groups.pop("replicate_group")
    elif tp == 1:
        shard_group, replicate_group = _build_groups(world, rank, shard_size)
    else:
        groups = _build_tp_mesh(world, rank, shard_size, tp)
        shard_group, replicate_group = groups.pop("shard_group"), groups.pop("replicate_group")
    experts = None
    if ep > 1:  # after the dense groups, in the same order on every rank (new_group is collective)
        experts = _EXPERT_MESH_BUILDER[0](rank=rank, world=world, ep=ep, device=_device_for(dist.get_backend()),
                                         name=name, ledger=ledger or process_ledger(), topology=topology, dp=dp,
                                         pp=pp)
    return Mesh(
        rank=rank,
        world=world,
        shard_size=shard_size,
        device=_device_for(dist.get_backend()),
        backend=dist.get_backend(),
        world_group=dist.group.WORLD,
        shard_group=shard_group,
        replicate_group=replicate_group,
        tp_size=tp,
        pp_size=pp,
        name=name,
        ledger=ledger or process_ledger(),
        topology=topology,
        experts=experts,
        **groups,
    )


def check_ep_layout(ep, dp: int, tp: int) -> None:
    """One line naming the problem and the fix, before any group exists. ep borrows its ranks from
    dp x tp (the experts are not tensor parallel): an ep group is whole tp groups (ep a multiple of
    tp) or a tp group is whole ep groups (tp a multiple of ep), so the two stay aligned."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r} must be a positive int (ep=1 is no expert parallelism)")
    world = dp * tp
    if world % ep:
        ranks = f"{dp} data-parallel ranks" if tp == 1 else f"{world} data-parallel x tp ranks (dp {dp} x tp {tp})"
        raise ValueError(f"ep={ep} does not divide the {ranks}, so its product with the expert-data-parallel ranks "
                         f"is not the world size; pick a divisor of {world}")
    if tp > 1 and ep % tp and tp % ep:
        raise ValueError(f"ep={ep} with tp={tp}: an ep group must hold whole tp groups or lie inside one; pick an ep "
                         f"that is a multiple or a divisor of tp={tp}")


_EXPERT_MESH_BUILDER: list = []
"""Builds ``Mesh.experts`` (zeroshard/comm/expert_mesh.py). Handed to this module by
zeroshard/comm/__init__.py, as the topology gather is: that mesh is a Mesh, so importing it here
would be circular."""


def use_expert_mesh_builder(builder) -> None:
    """Make ``builder(rank=, world=, ep=, device=, name=, ledger=, topology=, dp=, pp=) -> Mesh`` what
    ``init(ep=)`` and ``new_mesh(ep=)`` call (with ``pp > 1``: one expert mesh per pipeline stage)."""
    _EXPERT_MESH_BUILDER[:] = [builder]


def runs_and_strides(world: int, rank: int, size: int) -> tuple[object, object]:
    """This rank's group among the runs of ``size`` consecutive ranks, and its group among the
    ranks ``size`` apart. new_group is collective over the whole world, so every rank creates
    every group, in the same order, and keeps only its own."""
    run_group = stride_group = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            run_group = group
    for offset in range(size):
        ranks = list(range(offset, world, size))
        group = dist.new_group(ranks)
        if rank in ranks:
            stride_group = group
    return run_group, stride_group


def _build_groups(world: int, rank: int, shard_size: int):
    if shard_size == world:
        return dist.group.WORLD, None
    return runs_and_strides(world, rank, shard_size)


def _build_tp_mesh(world: int, rank: int, shard_size: int, tp: int) -> dict:
    """The ("replicate", "shard", "tp") DeviceMesh and its groups, plus the data-parallel group
    (every rank with the same tp index), which reduces a stage-0 gradient and broadcasts init values."""
    from torch.distributed.device_mesh import init_device_mesh

    replicate = world // tp // shard_size
    device_mesh = init_device_mesh(_device_type(), (replicate, shard_size, tp), mesh_dim_names=MESH_DIMS)
    return {
        "device_mesh": device_mesh,
        "tp_group": device_mesh.get_group("tp"),
        "shard_group": device_mesh.get_group("shard"),
        "replicate_group": device_mesh.get_group("replicate") if replicate > 1 else None,
        "dp_group": _stage_dp_group(world, rank, 1, tp),
    }


def _device_type() -> str:
    backend = dist.get_backend()
    return _BACKEND_DEVICES.get(backend) or ("cuda" if backend == "nccl" else "cpu")


def _stage_dp_group(world: int, rank: int, pp: int, tp: int):
    """This rank's data-parallel group within its pipeline stage: the stage's ranks with its tp
    index. new_group is collective over the world, so every rank builds every stage's groups, in
    the same order."""
    stage_world, mine = world // pp, None
    for stage in range(pp):
        for offset in range(tp):
            ranks = list(range(stage * stage_world + offset, (stage + 1) * stage_world, tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


def _build_pp_mesh(world: int, rank: int, pp: int, shard_size: int, tp: int) -> dict:
    """The ("pp", "replicate", "shard", "tp") DeviceMesh and its groups, the data-parallel group of
    each stage (every rank of the stage with the same tp index) and the pp-ends group (a pp group's
    first and last rank, over which a tied embedding/head grad is summed)."""
    from torch.distributed.device_mesh import init_device_mesh

    replicate = world // pp // tp // shard_size
    device_mesh = init_device_mesh(_device_type(), (pp, replicate, shard_size, tp),
                                   mesh_dim_names=("pp",) + MESH_DIMS)
    stage_world = world // pp
    dp_group, ends_group = _stage_dp_group(world, rank, pp, tp), None
    for inner in range(stage_world):
        ranks = [inner, inner + (pp - 1) * stage_world]
        group = device_mesh.get_group("pp") if pp == 2 and rank in ranks else None
        if pp > 2:
            group = dist.new_group(ranks)
        if rank in ranks:
            ends_group = group
    return {
        "device_mesh": device_mesh,
        "pp_group": device_mesh.get_group("pp"),
        "pp_ends_group": ends_group,
        "tp_group": device_mesh.get_group("tp") if tp > 1 else None,
        "shard_group": device_mesh.get_group("shard"),
        "replicate_group": device_mesh.get_group("replicate") if replicate > 1 else None,
        "dp_group": dp_group,
    }


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

