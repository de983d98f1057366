"""The process group and the 2-D data-parallel mesh (replicate × shard).

Ranks are laid out replicate-major: rank = replicate_index * shard_size + shard_index, so a shard
group is a run of consecutive ranks. Under torchrun consecutive ranks share a node, which keeps the
all-gather / reduce-scatter traffic on the fast intra-node links and sends only the all-reduce of
the already-reduced shards across nodes.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Mesh:
    rank: int
    world: int
    shard_size: int
    device: torch.device
    backend: str
    world_group: object = dataclasses.field(repr=False)
    shard_group: object = dataclasses.field(repr=False)
    replicate_group: object | None = dataclasses.field(repr=False)

    @property
    def replicate_size(self) -> int:
        return self.world // self.shard_size

    @property
    def shard_rank(self) -> int:
        return self.rank % self.shard_size

    @property
    def replicate_rank(self) -> int:
        return self.rank // self.shard_size

    def describe(self) -> dict:
        return {
            "world": self.world,
            "shard_size": self.shard_size,
            "replicate_size": self.replicate_size,
            "backend": self.backend,
            "device": str(self.device),
        }


_MESH: Mesh | None = None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device_for(backend: str) -> torch.device:
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


def init(*, backend: str | None = None, shard_size: int | str | None = None, timeout_s: float = 600.0) -> Mesh:
    """Join (or create) the default process group from the environment and build the mesh.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as torchrun and our launcher set them. With
    no RANK in the environment it starts a one-process world, so library code runs unchanged in a
    plain ``python`` session. Calling it again returns the existing mesh.

    ``shard_size=k`` makes a hybrid mesh of world/k replicas × k shards (ZeRO stages 1-3 shard
    inside a group of k consecutive ranks and all-reduce across replicas); ``"node"`` takes k from
    LOCAL_WORLD_SIZE.
    """
    global _MESH
    if _MESH is not None:
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
    world, rank = dist.get_world_size(), dist.get_rank()
    shard_size = _resolve_shard_size(shard_size, world)
    if shard_size < 1 or world % shard_size != 0:
        raise ValueError(
            f"shard_size={shard_size} does not divide world size {world}; pick a divisor of {world} "
            "(shard_size == world is plain full sharding)"
        )
    shard_group, replicate_group = _build_groups(world, rank, shard_size)
    _MESH = Mesh(
        rank=rank,
        world=world,
        shard_size=shard_size,
        device=_device_for(dist.get_backend()),
        backend=dist.get_backend(),
        world_group=dist.group.WORLD,
        shard_group=shard_group,
        replicate_group=replicate_group,
    )
    return _MESH


def _build_groups(world: int, rank: int, shard_size: int):
    if shard_size == world:
        return dist.group.WORLD, None
    # new_group is collective over the whole world, so every rank creates every group in the
    # same order and keeps only its own.
    shard_group = replicate_group = None
    for start in range(0, world, shard_size):
        ranks = list(range(start, start + shard_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            shard_group = group
    for offset in range(shard_size):
        ranks = list(range(offset, world, shard_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            replicate_group = group
    return shard_group, replicate_group


def get_mesh() -> Mesh:
    if _MESH is None:
        raise RuntimeError("zeroshard is not initialised: call zs.init() first (every rank)")
    return _MESH


def shutdown() -> None:
    """Tear down the process group so a process can exit (or re-init) cleanly."""
    global _MESH
    _MESH = None
    if dist.is_initialized():
        dist.destroy_process_group()

