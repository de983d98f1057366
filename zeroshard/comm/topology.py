"""Where every rank lives: its host, and for each mesh dim whether the dim's groups stay inside one.

Pure logic over a list of per-rank facts (``RankFacts``), so it runs on the facts ``zs.init``
gathered from every rank (zeroshard/comm/topology_gather.py) and just as well on a synthetic host
list (tests, the planner's ``--topology 2x4``).

The mesh lays ranks out pp-major with tp innermost (zeroshard/comm/dims.py):
rank = ((pp_i * replicate + replicate_i) * shard + shard_i) * tp + tp_i. A dim's groups are the
ranks that differ only in that dim's index. ``ep`` is no factor of the world of its own: an expert
group is ``ep`` consecutive ranks borrowed from the data-parallel and tp ranks (the same pp index),
so it follows the tp and shard dims' locality when it divides them.

Two placements are refused or flagged, because a run with them is correct and only slow:

- ``tp`` or ``ep`` groups that span hosts put per-layer collectives on the critical path onto the
  host network: refused unless the caller overrides it (``CrossHostError``);
- hosts with different numbers of ranks break the equal host blocks the layout assumes, so
  ``shard_size="node"`` would mean different groups on different hosts: refused before any group
  is built (``UnevenHostsError``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Mapping, Sequence

from zeroshard.comm.names import Dim

LAYOUT = (Dim.PP, Dim.REPLICATE, Dim.SHARD, Dim.CP, Dim.TP)
"""The factors of the world, outermost first (``ep`` splits data-parallel ranks instead)."""

ALLOW_CROSS_HOST = "allow_cross_host"
"""The override's name: ``zs.init(allow_cross_host=True)``, ``--allow-cross-host``, TOML ``allow_cross_host``."""


class TopologyError(ValueError):
    """A layout that does not fit the hosts; the message names the problem and the fix."""


class UnevenHostsError(TopologyError):
    """Hosts hold different numbers of ranks."""


class CrossHostError(TopologyError):
    """A ``tp`` or ``ep`` group spans hosts and the override was not given.

    ``dim`` and ``groups`` say which; the CLI adds the planner's modelled cost of such a run."""

    def __init__(self, message: str, *, dim: Dim, size: int, ranks_per_host: int) -> None:
        super().__init__(message)
        self.dim, self.size, self.ranks_per_host = dim, size, ranks_per_host


@dataclasses.dataclass(frozen=True)
class RankFacts:
    """What one rank reports about where it runs (zeroshard/comm/host_probe.py reads them)."""

    rank: int
    host: str
    local_rank: int = 0
    device: str = "cpu"
    device_name: str = ""
    """CUDA: the device's name; CPU: the processor model."""
    device_count: int = 0
    """CUDA devices visible on the host (0 on a CPU run)."""
    links: str = ""
    """CUDA: how local devices connect ("NVLink", "PCIe", or nvidia-smi's matrix letters); CPU: ""."""
    socket: int | None = None
    """CPU: the package (socket) of the first core this rank may run on."""
    sockets: int | None = None
    """CPU: packages on the host."""
    interface: str = ""
    """The network interface the backend uses: GLOO_SOCKET_IFNAME, or what the hostname resolves to."""
    address: str = ""
    """That interface's address, when it could be read."""
    nccl_env: tuple[tuple[str, str], ...] = ()
    """The NCCL interface variables that are set (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...)."""
    memory_bytes: int = 0
    """Memory one device offers: CUDA: the device's total; CPU: the host's RAM (shared by its ranks)."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["nccl_env"] = dict(self.nccl_env)
        return out


def _rank_text(ranks: Sequence[int]) -> str:
    """"0-3" for a run, "0,2" otherwise."""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def rank_groups(sizes: Mapping[Dim, int], dim: Dim) -> list[list[int]]:
    """Every group of ``dim`` as a list of global ranks, for a mesh of ``sizes`` (1 for a dim not given)."""
    shape = [int(sizes.get(d, 1)) for d in LAYOUT]
    if dim == Dim.EP:
        ep = int(sizes.get(Dim.EP, 1))
        dp = [g for g in _groups_over(shape, (LAYOUT.index(Dim.REPLICATE), LAYOUT.index(Dim.SHARD),
                                                LAYOUT.index(Dim.TP)))]
        if ep < 1 or any(len(g) % ep for g in dp):
            raise TopologyError(f"ep={ep} does not divide the {len(dp[0])} data-parallel x tp ranks; pick a divisor")
        return [g[i:i + ep] for g in dp for i in range(0, len(g), ep)]
    return _groups_over(shape, (LAYOUT.index(dim),))


def _groups_over(shape: list[int], varying: tuple[int, ...]) -> list[list[int]]:
    """Groups of ranks whose coordinates differ only in the ``varying`` axes (row-major ranks)."""
    groups: dict[tuple, list[int]] = {}
    for rank, coords in enumerate(itertools.product(*[range(n) for n in shape])):
        key = tuple(c for i, c in enumerate(coords) if i not in varying)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


@dataclasses.dataclass(frozen=True)
class Topology:
    """Every rank's facts, in rank order, and what follows from them."""

    ranks: tuple[RankFacts, ...]

    @classmethod
    def from_hosts(cls, hosts: Sequence[str]) -> Topology:
        """A synthetic topology: ``hosts[r]`` is rank r's host (tests, the planner's ``--topology``)."""
        seen: dict[str, int] = {}
        facts = []
        for rank, host in enumerate(hosts):
            facts.append(RankFacts(rank=rank, host=host, local_rank=seen.get(host, 0)))
            seen[host] = seen.get(host, 0) + 1
        return cls(tuple(facts))

    @classmethod
    def grid(cls, hosts: int, ranks_per_host: int) -> Topology:
        """``hosts`` hosts of ``ranks_per_host`` consecutive ranks each, as torchrun numbers them."""
        return cls.from_hosts([f"host{h}" for h in range(hosts) for _ in range(ranks_per_host)])

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Host names in the order of their first rank."""
        return tuple(dict.fromkeys(f.host for f in self.ranks))

    def host_of(self, rank: int) -> str:
        return self.ranks[rank].host

    def ranks_on(self, host: str) -> list[int]:
        return [f.rank for f in self.ranks if f.host == host]

    def uneven_error(self) -> str | None:
        """The one-line error when hosts hold different numbers of ranks, else None."""
        counts = {h: self.ranks_on(h) for h in self.hosts}
        if len({len(r) for r in counts.values()}) <= 1:
            return None
        listed = "; ".join(f"{h} has {len(r)} (ranks {_rank_text(r)})" for h, r in counts.items())
        return (f"ranks per host differ: {listed}; the mesh is laid out in equal host blocks, so start the same "
                f"number of ranks on every host (torchrun --nproc-per-node N on each)")

    def check_even(self) -> None:
        error = self.uneven_error()
        if error is not None:
            raise UnevenHostsError(error)

    @property
    def ranks_per_host(self) -> int:
        self.check_even()
        return self.world // len(self.hosts)

    @property
    def shape_text(self) -> str:
        """"2 hosts x 2 ranks" (or "1 host x 4 ranks")."""
        n, k = len(self.hosts), self.ranks_per_host
        return f"{n} host{'s' if n != 1 else ''} x {k} rank{'s' if k != 1 else ''}"

    def group_hosts(self, group: Sequence[int]) -> list[str]:
        return list(dict.fromkeys(self.host_of(r) for r in group))

    def inside_host(self, sizes: Mapping[Dim, int]) -> dict[Dim, bool]:
        """For each mesh dim, whether every one of its groups holds ranks of one host only."""
        self._check_world(sizes)
        return {d: all(len(self.group_hosts(g)) == 1 for g in rank_groups(sizes, d)) for d in Dim}

    def _check_world(self, sizes: Mapping[Dim, int]) -> None:
        product = 1
        for d in LAYOUT:
            product *= int(sizes.get(d, 1))
        if product != self.world:
            raise TopologyError(f"the mesh {dict(sizes)} covers {product} ranks but {self.world} reported their "
                                "host; the layout must cover the world")

    def check_placement(self, sizes: Mapping[Dim, int], *, allow_cross_host: bool = False) -> None:
        """Refuse ``tp`` or ``ep`` groups that span hosts unless ``allow_cross_host``."""
        if allow_cross_host:
            return
        inside = self.inside_host(sizes)
        for dim in (Dim.TP, Dim.EP):
            if inside[dim]:
                continue
            group = next(g for g in rank_groups(sizes, dim) if len(self.group_hosts(g)) > 1)
            k = self.ranks_per_host
            raise CrossHostError(
                f"{dim} groups span hosts: {dim} group of ranks {_rank_text(group)} is on "
                f"{', '.join(self.group_hosts(group))} ({self.shape_text}), so every per-layer {dim} collective "
                f"crosses the host network; keep {dim} <= {k} (the ranks one host holds: the innermost dims stay on it), "
                f"or pass {ALLOW_CROSS_HOST}=True (--allow-cross-host, TOML {ALLOW_CROSS_HOST} = true) to run it anyway",
                dim=dim, size=int(sizes.get(dim, 1)), ranks_per_host=k)

    def host_sized_shard(self, sizes: Mapping[Dim, int]) -> int | None:
        """The shard size that keeps every shard group inside a host while replicating across hosts,
        when the current shard group spans hosts and such a size exists; else None."""
        if self.inside_host(sizes)[Dim.SHARD]:
            return None
        tp = int(sizes.get(Dim.TP, 1))
        dp = self.world // tp // int(sizes.get(Dim.PP, 1))
        per_host = self.ranks_per_host // tp if self.ranks_per_host % tp == 0 else 0
        if per_host < 2 or dp % per_host:  # a one-rank shard group is plain replication, no hybrid layout
            return None
        candidate = {**sizes, Dim.SHARD: per_host, Dim.REPLICATE: dp // per_host}
        return per_host if self.inside_host(candidate)[Dim.SHARD] else None

    def describe(self, sizes: Mapping[Dim, int]) -> dict[str, Any]:
        """What reports record: hosts x ranks, each rank's host, which dims stay inside a host, and
        one rank's facts per host (the others on a host repeat its device and link facts)."""
        even = self.uneven_error() is None
        inside = self.inside_host(sizes)
        first = {h: self.ranks[self.ranks_on(h)[0]] for h in self.hosts}
        return {
            "hosts": len(self.hosts),
            "ranks_per_host": self.ranks_per_host if even else None,
            "shape": self.shape_text if even else "uneven",
            "host_names": list(self.hosts),
            "rank_hosts": [f.host for f in self.ranks],
            "dims": {str(d): int(sizes.get(d, 1)) for d in Dim},
            "inside_host": {str(d): inside[d] for d in Dim},
            "facts": {h: f.to_dict() for h, f in first.items()},
        }


def placement_text(summary: Mapping[str, Any]) -> str:
    """One line from ``Topology.describe``: "2 hosts x 2 ranks; inside a host: shard, tp; across hosts: replicate".

    Only dims of size > 1 are named: a one-rank dim is trivially inside a host."""
    dims, inside = summary["dims"], summary["inside_host"]
    used = [d for d in dims if dims[d] > 1]
    within = [d for d in used if inside[d]]
    across = [d for d in used if not inside[d]]
    parts = [summary["shape"]]
    if within:
        parts.append("inside a host: " + ", ".join(within))
    if across:
        parts.append("across hosts: " + ", ".join(across))
    return "; ".join(parts)
