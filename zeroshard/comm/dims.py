"""The parallel layout, written once: ``ParallelDims`` holds the degrees, checks them, does the rank
arithmetic and builds the ``Mesh`` of them.

Ranks are laid out pp-major with ``tp`` innermost:
rank = ((pp_index * replicate + replicate_index) * shard + shard_index) * tp + tp_index.
A pipeline stage's ranks are therefore consecutive, so its ZeRO and TP groups stay inside a node and
only the stage-to-stage sends cross nodes (docs/pipeline.md). A TP group is a run of consecutive
ranks and, without TP, a shard group is too: under torchrun consecutive ranks share a node, so TP's
per-layer all-reduces (on the critical path) stay on the fastest links, then ZeRO's all-gather /
reduce-scatter, and only the all-reduce of already-reduced shards crosses replicas.

``ep`` is not a factor of the world of its own: an ep group is a run of ``ep`` consecutive ranks
borrowed from each stage's data-parallel x tp ranks (docs/expert_parallel.md). ``cp`` (context
parallelism, docs/context_parallel.md) sits between shard and tp:
rank = (((pp_index * replicate + replicate_index) * shard + shard_index) * cp + cp_index) * tp + tp_index,
so a cp group is tp-strided ranks next to each other (inside a host when cp x tp fits one). A cp rank
holds other tokens of the same samples, so its grads sum with the data-parallel ranks' and ZeRO
shards over shard x cp ranks (``zero_shard``), as torchtitan shards FSDP over dp_shard x cp.

The mesh, the step schedule, the planner's ``PlanSpec`` and the simulator's ``Layout`` all hold one
of these; none of them keeps a degree of its own.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from zeroshard.comm.mesh_build import build_mesh
from zeroshard.comm.names import Dim, Group, group_of
from zeroshard.comm.topology import rank_groups

if TYPE_CHECKING:
    from zeroshard.comm.ledger import Ledger
    from zeroshard.comm.mesh import Mesh
    from zeroshard.comm.topology import Topology

SHAPE_DIMS = ("pp", "replicate", "shard", "cp", "ep", "tp")
"""The names ``mesh_shape`` may use, outermost first. ``pp`` is outside the data-parallel dims (a
stage's ranks are consecutive). ``ep`` is carved out of the data-parallel ranks (torchtitan's
dp_shard_in_ep): with ``names=("shard", "ep")`` the dense params are sharded over shard × ep ranks
and each expert's params over the ``shard`` ranks that hold it."""

MESH_DIMS = ("pp", "replicate", "shard", "cp", "tp")
"""The DeviceMesh's dims, outermost first (``tp`` innermost, consecutive ranks)."""


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int (1 is no split along {name})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees of one layout: pp x replicate x shard x tp ranks, ep borrowed from each stage's
    data-parallel x tp ranks, cp ranks splitting each sequence. Built valid or not at all."""

    pp: int = 1
    """Pipeline stages: each a run of ``world / pp`` consecutive ranks."""
    replicate: int = 1
    """Replicas of each shard group (hybrid sharding all-reduces over them)."""
    shard: int = 1
    """Ranks a flat buffer is sharded over (ZeRO stages 1-3)."""
    tp: int = 1
    """Tensor-parallel ranks one block is split over, innermost."""
    ep: int = 1
    """Expert-parallel ranks one MoE layer's experts are split over (runs of dp x tp)."""
    cp: int = 1
    """Context parallelism: ranks one sequence is split over (between shard and tp)."""

    def __post_init__(self) -> None:
        for name in ("pp", "replicate", "shard", "tp", "ep", "cp"):
            _positive(name, getattr(self, name))
        # A cp rank routes its own tokens, as a data-parallel rank does: ep borrows from dp x cp x tp.
        check_ep_layout(self.ep, self.dp, self.tp, self.pp, cp=self.cp)

    # ------------------------------------------------------------------ construction

    @classmethod
    def of(cls, world: int, *, pp: int = 1, tp: int = 1, shard: int | None = None, ep: int = 1,
           cp: int = 1) -> ParallelDims:
        """The layout of ``world`` ranks: ``pp`` stages, ``tp`` ranks per block, ``cp`` ranks per
        sequence, ZeRO over groups of ``shard`` of a stage's data-parallel ranks (None: all of them,
        each with its cp ranks) and replicas over the rest."""
        _positive("world", world)
        _positive("pp", pp)
        if world % pp:
            raise ValueError(f"pp={pp} does not divide world size {world}; pick a divisor of {world} (pp=1 is no "
                             "pipeline parallelism)")
        stage_world = world // pp
        _positive("tp", tp)
        if stage_world % tp:
            where = f"world size {world}" if pp == 1 else f"the {stage_world} ranks of a pipeline stage (world {world} / pp {pp})"
            raise ValueError(f"tp={tp} does not divide {where}; pick a divisor of {stage_world} (tp=1 is no tensor "
                             "parallelism)")
        _positive("cp", cp)
        if (stage_world // tp) % cp:
            raise ValueError(f"cp={cp} does not divide the {stage_world // tp} ranks of a stage without tp (world {world}"
                             f"{f' / pp {pp}' if pp > 1 else ''}{f' / tp {tp}' if tp > 1 else ''}); pick a divisor "
                             f"of {stage_world // tp} (cp=1 is no context parallelism)")
        dp = stage_world // tp // cp
        shard = dp if shard is None else shard
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or dp % shard:
            raise ValueError(f"shard_size={shard} does not divide the {dp} data-parallel ranks (world {world} / tp {tp}"
                             f"{f' / pp {pp}' if pp > 1 else ''}); pick a divisor of {dp} (shard_size == {dp} is plain "
                             "full sharding)")
        return cls(pp=pp, replicate=dp // shard, shard=shard, tp=tp, ep=ep, cp=cp)

    @classmethod
    def from_shape(cls, mesh_shape, names, world: int) -> ParallelDims:
        """The layout a named shape spells, such as ``mesh_shape=(2, 2), names=("shard", "tp")``. An
        ``ep`` entry is part of the dense shard size (each expert is sharded over ``shard``)."""
        shape = tuple(mesh_shape)
        names = tuple(names or ("replicate", "shard", "tp")[-len(shape):])
        if len(shape) != len(names) or len(set(names)) != len(names) or \
                [n for n in SHAPE_DIMS if n in names] != list(names):
            raise ValueError(f"names {names} must be distinct dims out of {SHAPE_DIMS}, in that order, one per entry "
                             f"of mesh_shape {shape}")
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in shape):
            raise ValueError(f"mesh_shape {shape} must hold positive ints")
        product = 1
        for n in shape:
            product *= n
        if product != world:
            raise ValueError(f"mesh_shape {shape} covers {product} ranks but the world has {world}; make the product "
                             f"of mesh_shape equal the world size (WORLD_SIZE / --nproc)")
        dims = dict(zip(names, shape))
        tp, ep, pp, cp = dims.get("tp", 1), dims.get("ep", 1), dims.get("pp", 1), dims.get("cp", 1)
        shard = dims.get("shard", world // tp // ep // pp // cp // dims.get("replicate", 1)) * ep
        return cls.of(world, pp=pp, tp=tp, shard=shard, ep=ep, cp=cp)

    def with_shard(self, shard: int | None) -> ParallelDims:
        """This layout with ZeRO over groups of ``shard`` data-parallel ranks (None: all of them),
        replicated over the rest: what a stage that shards nothing (shard 1) or a hybrid plan runs."""
        return ParallelDims.of(self.world, pp=self.pp, tp=self.tp, shard=shard, ep=self.ep, cp=self.cp)

    # ------------------------------------------------------------------ sizes

    @property
    def world(self) -> int:
        """Every rank of the job."""
        return self.pp * self.stage_world

    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage (replicate x shard x cp x tp): the world when pp is 1."""
        return self.dp * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks of a stage that see different batches."""
        return self.replicate * self.shard

    @property
    def zero_shard(self) -> int:
        """Ranks a ZeRO flat buffer is sharded over: a shard group's ranks with each of their cp
        ranks (a cp rank's grads sum like a data-parallel rank's)."""
        return self.shard * self.cp

    @property
    def grad_dp(self) -> int:
        """Ranks of a stage whose grads are summed: data-parallel x cp (the ``dp`` group's size)."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: the ranks of a stage holding the same experts (experts are
        not tp split, so ep's ranks come from dp x tp)."""
        return self.stage_world // self.ep

    @property
    def hybrid(self) -> bool:
        """Sharded inside groups smaller than the data-parallel ranks, replicated across them."""
        return self.replicate > 1

    @property
    def dp_name(self) -> Group:
        """The group spanning the data-parallel ranks: the world without tp or pp, else ``dp``."""
        return Group.WORLD if self.tp == 1 and self.pp == 1 else Group.DP  # the dp group spans cp too

    @property
    def dp_group(self) -> str:
        """``dp_name`` as the step schedule's events spell a group."""
        return self.dp_name.value

    def sizes(self) -> dict[Dim, int]:
        """Every mesh dim's size, outermost first; 1 for a dim this layout does not use."""
        return {Dim.PP: self.pp, Dim.REPLICATE: self.replicate, Dim.SHARD: self.shard, Dim.CP: self.cp,
                Dim.TP: self.tp, Dim.EP: self.ep}

    def __getitem__(self, dim: Dim | str) -> int:
        return self.sizes()[Dim(dim)]

    def __iter__(self) -> Iterator[Dim]:
        return iter(self.sizes())

    def group_size(self, group: str | Group) -> int:
        """Ranks in one group of ``group`` (world, shard, replicate, tp, dp, pp, pp_ends, ep, cp): the
        shard and dp groups span the cp ranks."""
        g = group_of(group)
        return {Group.WORLD: self.world, Group.SHARD: self.zero_shard, Group.REPLICATE: self.replicate,
                Group.TP: self.tp, Group.DP: self.grad_dp, Group.PP: self.pp, Group.PP_ENDS: min(self.pp, 2),
                Group.EP: self.ep, Group.CP: self.cp}[g]

    def size(self, group: str) -> int:
        """``group_size`` by name, as the step schedule's events spell their groups."""
        return self.group_size(group)

    # ------------------------------------------------------------------ rank arithmetic

    def coords(self, rank: int) -> dict[Dim, int]:
        """Where ``rank`` sits: its index along pp, replicate, shard, cp and tp, and its ep index."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world} ranks")
        inner = self.cp * self.tp
        return {Dim.PP: rank // self.stage_world, Dim.REPLICATE: (rank // (self.shard * inner)) % self.replicate,
                Dim.SHARD: (rank // inner) % self.shard, Dim.CP: (rank // self.tp) % self.cp, Dim.TP: rank % self.tp,
                Dim.EP: (rank % self.stage_world) % self.ep}

    def rank_of(self, *, pp: int = 0, replicate: int = 0, shard: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The inverse of ``coords`` over the dense dims."""
        return (((pp * self.replicate + replicate) * self.shard + shard) * self.cp + cp) * self.tp + tp

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel batch of its stage ``rank`` reads (its cp ranks read the same one)."""
        return (rank // (self.tp * self.cp)) % self.dp

    def zero_rank(self, rank: int) -> int:
        """``rank``'s index in its ZeRO shard group (shard x cp)."""
        c = self.coords(rank)
        return c[Dim.SHARD] * self.cp + c[Dim.CP]

    def groups(self, dim: Dim | str) -> list[list[int]]:
        """Every group of ``dim`` as a list of global ranks (ep: runs of ep of each stage's dp x tp)."""
        return rank_groups(self.sizes(), Dim(dim))

    def zero_groups(self) -> list[list[int]]:
        """ZeRO's groups: the ranks with one (pp, replicate, tp) index, shard x cp of them."""
        return [[self.rank_of(pp=p, replicate=r, shard=s, cp=c, tp=t) for s in range(self.shard) for c in range(self.cp)]
                for p in range(self.pp) for r in range(self.replicate) for t in range(self.tp)]

    def stage_dp_groups(self) -> list[list[int]]:
        """Each stage's data-parallel groups: its ranks with one tp index (replicate x shard x cp)."""
        return [list(range(stage * self.stage_world + offset, (stage + 1) * self.stage_world, self.tp))
                for stage in range(self.pp) for offset in range(self.tp)]

    def describe(self) -> dict[str, int]:
        return {"world": self.world, "pp": self.pp, "replicate": self.replicate, "shard": self.shard,
                "tp": self.tp, "ep": self.ep, "dp": self.dp, **({"cp": self.cp} if self.cp > 1 else {})}

    # ------------------------------------------------------------------ the mesh

    def build(self, topology: Topology | None = None, *, name: str = "default", ledger: Ledger | None = None,
              allow_cross_host: bool = False) -> Mesh:
        """This layout's ``Mesh`` over the joined process group: one torch ``DeviceMesh`` over
        (pp, replicate, shard, tp) whose dims give the groups, plus the expert mesh with ``ep > 1``.
        Collective: every rank calls it with the same dims, in the same order."""
        return build_mesh(self, topology, name=name, ledger=ledger, allow_cross_host=allow_cross_host)


def check_ep_layout(ep: Any, dp: int, tp: int, pp: int = 1, *, cp: int = 1) -> None:
    """One line naming the problem and the fix, before any group exists. ep borrows its ranks from
    dp x cp x tp (the experts are not tensor parallel; a cp rank routes its own tokens): an ep group
    is whole tp groups (ep a multiple of tp) or a tp group is whole ep groups (tp a multiple of ep),
    so the two stay aligned."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r} must be a positive int (ep=1 is no expert parallelism)")
    world = dp * cp * tp
    if world % ep:
        ranks = f"{dp} data-parallel ranks" if tp == 1 else f"{world} data-parallel x tp ranks (dp {dp} x tp {tp})"
        ranks = f"{world} data-parallel x cp ranks (dp {dp} x cp {cp}{f' x tp {tp}' if tp > 1 else ''})" if cp > 1 \
            else ranks
        ranks += " of a pipeline stage" if pp > 1 else ""
        raise ValueError(f"ep={ep} does not divide the {ranks}, so its product with the expert-data-parallel ranks "
                         f"is not the world size; pick a divisor of {world}")
    if tp > 1 and ep % tp and tp % ep:
        raise ValueError(f"ep={ep} with tp={tp}: an ep group must hold whole tp groups or lie inside one; pick an ep "
                         f"that is a multiple or a divisor of tp={tp}")


def dims_of(sizes: Mapping[str, int]) -> ParallelDims:
    """A ParallelDims from a dict of its degrees (as ``describe`` or a manifest writes them)."""
    return ParallelDims(**{k: int(v) for k, v in sizes.items() if k in ("pp", "replicate", "shard", "tp", "ep", "cp")})
