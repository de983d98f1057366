"""Joining the process group and building meshes: ``zs.init`` and ``new_mesh``.

Both resolve their layout arguments into one ``ParallelDims`` (zeroshard/comm/dims.py) and build
it; the degrees are checked there, once, whoever asks (``zs.init``, the trainer, the planner).
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from zeroshard.comm import mesh as _meshes
from zeroshard.comm.devices import choose_backend
from zeroshard.comm.dims import ParallelDims
from zeroshard.comm.ledger import Ledger
from zeroshard.comm.mesh import Mesh
from zeroshard.comm.mesh_build import device_for
from zeroshard.comm.topology import Topology, UnevenHostsError
from zeroshard.comm.topology_gather import gather_topology


def resolve_dims(*, world: int, shard_size: int | str | None = None, tp: int = 1, pp: int = 1, ep: int = 1,
                 mesh_shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None,
                 topology: Topology | None = None, cp: int = 1) -> ParallelDims:
    """The ParallelDims that ``init``'s layout arguments spell for ``world`` ranks. ``shard_size``:
    None shards over every data-parallel rank; "node" over the ranks of one host (the gathered
    topology's, else torchrun's LOCAL_WORLD_SIZE) divided by tp."""
    if mesh_shape is not None:
        if shard_size is not None or tp != 1 or ep != 1 or pp != 1 or cp != 1:
            raise ValueError("pass either mesh_shape/names or shard_size/tp/ep/pp/cp, not both")
        return ParallelDims.from_shape(mesh_shape, names, world)
    if shard_size == "node":
        if topology is not None and topology.uneven_error() is None:
            # The hosts the ranks reported, not LOCAL_WORLD_SIZE: a launcher may not set it, and one
            # that runs several "hosts" on a machine (ZEROSHARD_HOST) sets it to the machine's count.
            inner = (tp if isinstance(tp, int) and tp > 0 else 1) * (cp if isinstance(cp, int) and cp > 0 else 1)
            shard_size = max(1, topology.ranks_per_host // inner)
        else:  # torchrun's ranks per host; without it, one host
            local = os.environ.get("LOCAL_WORLD_SIZE")
            shard_size = max(1, int(local) // max(1, tp) // max(1, cp)) if local else None
    elif shard_size is not None and not isinstance(shard_size, int):
        raise ValueError(f"shard_size must be an int, 'node' or None, got {shard_size!r}")
    return ParallelDims.of(world, pp=pp, tp=tp, shard=shard_size, ep=ep, cp=cp)


def _check_existing(mesh: Mesh, asked: ParallelDims | None, tp: int, ep: int, pp: int, cp: int = 1) -> None:
    """A second ``init`` that names a tensor-, expert- or pipeline-parallel shape must ask for the
    mesh that exists: returning another one silently would run a different layout than the caller wrote."""
    if asked is not None:
        tp, ep, pp, cp = asked.tp, asked.ep, asked.pp, asked.cp
    for dim, want, has in (("tp", tp, mesh.tp_size), ("ep", ep, mesh.ep_size), ("pp", pp, mesh.pp_size),
                           ("cp", cp, mesh.cp_size)):
        if want != has:
            raise ValueError(f"the mesh already exists with {dim}={has}; call zs.shutdown() before zs.init() "
                             f"with {dim}={want}")


def init(*, backend: str | None = None, shard_size: int | str | None = None, tp: int = 1, pp: int = 1,
         mesh_shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None,
         timeout_s: float = 600.0, allow_cross_host: bool = False, ep: int = 1, cp: int = 1,
         dims: ParallelDims | None = None) -> Mesh:
    """Join (or create) the default process group from the environment and build the mesh.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as torchrun and our launcher set them. With
    no RANK in the environment it starts a one-process world, so library code runs unchanged in a
    plain ``python`` session. Calling it again returns the existing mesh.

    The layout is ``dims`` (a ``ParallelDims``) or spelled by its degrees:
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
    ``cp=c`` splits every sequence over c ranks (between shard and tp): ZeRO shards over shard × cp
    and attention exchanges keys/values over the cp group. See docs/context_parallel.md.

    Every rank's host and device facts are gathered first (``Mesh.topology``). Hosts with different
    numbers of ranks, and a tp group spanning hosts, are refused before any group is built; pass
    ``allow_cross_host=True`` to run tp across hosts anyway. See docs/topology.md.
    """
    existing = _meshes.current_mesh()
    if existing is not None:
        if mesh_shape is not None:
            dims = ParallelDims.from_shape(mesh_shape, names, existing.world)  # a wrong shape: its own error
        if dims is not None or tp != 1 or ep != 1 or pp != 1 or cp != 1:
            _check_existing(existing, dims, tp, ep, pp, cp)
        return existing
    backend = choose_backend(backend)
    if not dist.is_initialized():
        device_for(backend)  # a device the machine cannot give is refused before any process group
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            # Via our helper: after a torchrun restart the env:// store still holds the dead
            # attempt's keys (see zeroshard/comm/elastic.py).
            from zeroshard.comm.elastic import init_process_group_from_env

            init_process_group_from_env(backend, timeout)
        else:
            # An in-memory store, not env vars: a plain process must not look like a torchrun
            # worker to the subprocesses it starts.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    topology = _join_topology()
    if dims is None:
        dims = resolve_dims(world=dist.get_world_size(), shard_size=shard_size, tp=tp, pp=pp, ep=ep,
                            mesh_shape=mesh_shape, names=names, topology=topology, cp=cp)
    mesh = dims.build(topology, name="default", allow_cross_host=allow_cross_host)
    return _meshes.register(mesh, default=True)


def _world_mesh() -> Mesh:
    """A mesh of the world group alone: what the topology gather runs on before any group exists."""
    world = dist.get_world_size()
    return Mesh(rank=dist.get_rank(), dims=ParallelDims(shard=world), device=device_for(dist.get_backend()),
                backend=dist.get_backend(), world_group=dist.group.WORLD, shard_group=dist.group.WORLD,
                replicate_group=None)


def _join_topology() -> Topology:
    """Every rank's facts, checked before any group is built: a torchrun host whose local world does
    not divide the world is refused before the gather, uneven hosts right after it (every rank sees
    the same list, so every rank raises the same error instead of some hanging in a later group)."""
    world, local = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local and world % local:
        raise UnevenHostsError(f"ranks per host differ: this host runs {local} of the world's {world} ranks, which "
                               "is not an equal share; start the same number of ranks on every host "
                               "(torchrun --nproc-per-node N on each)")
    topology = gather_topology(_world_mesh())
    topology.check_even()
    return topology


def new_mesh(*, shard_size: int | str | None = None, tp: int = 1, pp: int = 1, mesh_shape: tuple[int, ...] | None = None,
             names: tuple[str, ...] | None = None, name: str, ledger: Ledger | None = None,
             allow_cross_host: bool = False, ep: int = 1, cp: int = 1, dims: ParallelDims | None = None) -> Mesh:
    """Another parallel context over the process group ``zs.init`` joined, next to the default one.

    Pass it to ``zs.shard(model, mesh=...)``: that model's collectives then run on this mesh's
    groups, so two models sharded over different layouts train in one process. It takes the
    layout arguments of ``init`` (or ``dims``). ``name`` labels its ledger records (``"experts"``,
    ``"stage1"``); ``ledger`` gives it a ledger of its own instead of the process's. Like ``init`` it
    is collective: every rank builds the same meshes in the same order.
    """
    default = _meshes.current_mesh()
    if default is None:
        raise RuntimeError("zs.new_mesh needs the process group: call zs.init() first (every rank)")
    if not isinstance(name, str) or not name or name == "default":
        raise ValueError(f"new_mesh needs a name of its own for the ledger (such as 'experts'), got {name!r}")
    if any(m.name == name for m in _meshes.all_meshes()):
        raise ValueError(f"a mesh named {name!r} exists already; give each zs.new_mesh its own name")
    if dims is None:
        dims = resolve_dims(world=dist.get_world_size(), shard_size=shard_size, tp=tp, pp=pp, ep=ep,
                            mesh_shape=mesh_shape, names=names, topology=default.topology, cp=cp)
    mesh = dims.build(default.topology, name=name, ledger=ledger, allow_cross_host=allow_cross_host)
    return _meshes.register(mesh, default=False)
