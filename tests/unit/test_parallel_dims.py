"""One ParallelDims per layout the suite runs: the mesh it builds, the planner's spec, the
simulator's layout and the run's config all read their sizes from it, and none of them keeps a
degree of its own.

The mesh is built in this process over torch's "fake" process group (any world size, no peers), so
each layout's real groups are checked against the rank arithmetic without spawning ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from zeroshard.comm.dims import ParallelDims
from zeroshard.comm.mesh import Mesh
from zeroshard.comm.names import Dim, Group
from zeroshard.comm.world import resolve_dims
from zeroshard.tools.planner.api import plan_dims
from zeroshard.tools.planner.spec import PlanSpec
from zeroshard.tools.sim.step import Layout
from zeroshard.trainer.config import TrainConfig

LAYOUTS = [
    ParallelDims(),                                   # one process
    ParallelDims(shard=2),                            # stages 0-3 at world 2
    ParallelDims(shard=4),
    ParallelDims(replicate=2, shard=2),               # hybrid, --shard-size 2
    ParallelDims(replicate=4, shard=2),
    ParallelDims(tp=2),
    ParallelDims(shard=2, tp=2),                      # mesh_shape=(2, 2)
    ParallelDims(replicate=2, shard=2, tp=2),
    ParallelDims(pp=2),
    ParallelDims(pp=2, shard=2),
    ParallelDims(pp=3),
    ParallelDims(pp=4),
    ParallelDims(pp=2, tp=2),
    ParallelDims(pp=2, shard=2, tp=2),
    ParallelDims(shard=2, ep=2),
    ParallelDims(shard=4, ep=2),
    ParallelDims(shard=4, ep=4),
    ParallelDims(shard=8, ep=8),
    ParallelDims(shard=2, tp=2, ep=2),
    ParallelDims(shard=2, tp=2, ep=4),
    ParallelDims(pp=2, shard=2, ep=2),
]
DEGREES = {"world", "shard_size", "tp_size", "pp_size", "ep", "tp", "pp", "shards", "dense_dp"}
"""Names a second copy of a degree would have."""


def _name(d: ParallelDims) -> str:
    return "x".join(f"{k}{v}" for k, v in d.describe().items() if k not in ("world", "dp") and v > 1) or "one"


@pytest.fixture
def fake_world():
    """A fake process group of ``world`` ranks in which this process is ``rank``."""
    def join(world: int, rank: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


@pytest.mark.parametrize("dims", LAYOUTS, ids=_name)
def test_the_mesh_the_spec_and_the_layout_read_one_parallel_dims(dims, fake_world):
    rank = dims.world - 1  # the last rank: every index is at its largest
    fake_world(dims.world, rank)
    mesh = dims.build()
    assert mesh.dims is dims
    sizes = (mesh.world, mesh.pp_size, mesh.replicate_size, mesh.shard_size, mesh.tp_size, mesh.ep_size, mesh.dp_size)
    assert sizes == (dims.world, dims.pp, dims.replicate, dims.shard, dims.tp, dims.ep, dims.dp)
    # Each group the DeviceMesh built holds the ranks the arithmetic says.
    for dim, group in ((Dim.SHARD, Group.SHARD), (Dim.TP, Group.TP), (Dim.PP, Group.PP), (Dim.REPLICATE, Group.REPLICATE)):
        if dims[dim] > 1:
            mine = next(g for g in dims.groups(dim) if rank in g)
            assert _ranks(mesh.group(group)) == mine, dim
    if dims.tp > 1 or dims.pp > 1:
        assert _ranks(mesh.group(Group.DP)) == next(g for g in dims.stage_dp_groups() if rank in g)
    coords = dims.coords(rank)
    assert (mesh.pp_rank, mesh.replicate_rank, mesh.shard_rank, mesh.tp_rank) == \
        (coords[Dim.PP], coords[Dim.REPLICATE], coords[Dim.SHARD], coords[Dim.TP])
    assert dims.rank_of(pp=coords[Dim.PP], replicate=coords[Dim.REPLICATE], shard=coords[Dim.SHARD],
                        tp=coords[Dim.TP]) == rank
    if dims.ep > 1:
        experts = mesh.experts
        assert experts is not None and experts.dims is dims
        assert (experts.world, experts.shard_size, experts.ep_size, experts.dp_size) == \
            (dims.stage_world, dims.edp, dims.ep, dims.dp)
        assert _ranks(experts.group(Group.EP)) == next(g for g in dims.groups(Dim.EP) if rank in g)

    # The planner: its spec holds the same dims, and so does the layout it resolves from its arguments.
    spec = PlanSpec(dims=dims, mp=_mp(), optimizer=torch.optim.AdamW, batch=dims.dp * 2, seq=8)
    assert spec.dims is dims
    assert (spec.world, spec.pp, spec.tp, spec.ep, spec.dp, spec.edp) == \
        (dims.stage_world, dims.pp, dims.tp, dims.ep, dims.dp, dims.edp)
    assert spec.shard_size == (dims.shard if dims.replicate > 1 else None)
    asked = plan_dims(dims.stage_world, pp=dims.pp, tp=dims.tp, ep=dims.ep,
                      shard_size=dims.shard if dims.hybrid else None)
    assert asked == dims
    # zs.init's arguments resolve to the same dims too.
    assert resolve_dims(world=dims.world, pp=dims.pp, tp=dims.tp, ep=dims.ep, shard_size=dims.shard) == dims

    # The run's config: its [parallel] degrees over nproc ranks make the same dims.
    cfg = TrainConfig(model="tiny-moe" if dims.ep > 1 else "tiny", nproc=dims.world, pp=dims.pp, tp=dims.tp,
                      ep=dims.ep, shard_size=dims.shard if dims.hybrid else None, batch=dims.dp * 2)
    assert cfg.dims == dims

    # The simulator prices one stage: its layout holds that stage's dims.
    stage = dataclasses.replace(dims, pp=1)
    layout = Layout(dims=stage, stage=3)
    assert layout.dims is stage and layout.mesh is stage
    assert (layout.world, layout.tp, layout.ep, layout.dp, layout.shard_group, layout.replicas) == \
        (dims.stage_world, dims.tp, dims.ep, dims.dp, dims.shard, dims.replicate)
    assert Layout(dims=stage, stage=0).mesh == stage.with_shard(1)  # stage 0 shards nothing


def _mp():
    from zeroshard.runtime.precision import MixedPrecision

    return MixedPrecision()


@pytest.mark.parametrize("holder", [Mesh, PlanSpec, Layout], ids=lambda c: c.__name__)
def test_no_holder_keeps_a_degree_of_its_own(holder):
    fields = {f.name for f in dataclasses.fields(holder)}
    assert "dims" in fields
    assert sorted(fields & DEGREES) == []


@pytest.mark.parametrize("call, message", [
    (lambda: ParallelDims.of(4, tp=3), "tp=3 does not divide world size 4"),
    (lambda: ParallelDims.of(8, pp=2, tp=3), "tp=3 does not divide the 4 ranks of a pipeline stage"),
    (lambda: ParallelDims.of(6, pp=4), "pp=4 does not divide world size 6"),
    (lambda: ParallelDims.of(8, tp=2, shard=3), "shard_size=3 does not divide the 4 data-parallel ranks"),
    (lambda: ParallelDims.of(4, ep=3), "ep=3 does not divide the 4 data-parallel ranks"),
    (lambda: ParallelDims.of(4, cp=3), "cp=3 does not divide the 4 ranks of a stage without tp"),
    (lambda: ParallelDims(shard=1, cp=2, ep=4), r"ep=4 does not divide the 2 data-parallel x cp ranks \(dp 1 x cp 2\)"),
    (lambda: ParallelDims(tp=0), "tp=0 must be a positive int"),
])
def test_a_bad_layout_is_one_line_naming_the_fix(call, message):
    with pytest.raises(ValueError, match=message) as e:
        call()
    assert "\n" not in str(e.value)


def test_sizes_and_rank_arithmetic():
    d = ParallelDims.of(16, pp=2, tp=2, shard=2)
    assert (d.world, d.stage_world, d.dp, d.replicate, d.edp) == (16, 8, 4, 2, 8)
    assert d[Dim.REPLICATE] == 2 and d.sizes()[Dim.PP] == 2
    assert d.coords(13) == {Dim.PP: 1, Dim.REPLICATE: 1, Dim.SHARD: 0, Dim.CP: 0, Dim.TP: 1, Dim.EP: 0}
    assert d.groups(Dim.TP)[:2] == [[0, 1], [2, 3]] and d.groups(Dim.SHARD)[0] == [0, 2]
    assert d.groups(Dim.PP)[0] == [0, 8] and d.stage_dp_groups()[0] == [0, 2, 4, 6]
    assert d.with_shard(None) == ParallelDims(pp=2, shard=4, tp=2)
    assert d.group_size("dp") == 4 and d.dp_group == "dp" and ParallelDims(shard=2).dp_group == "world"


def test_cp_sits_between_shard_and_tp_and_zero_shards_over_shard_times_cp():
    d = ParallelDims.of(16, tp=2, cp=2, shard=2)  # replicate 2 x shard 2 x cp 2 x tp 2
    assert (d.replicate, d.shard, d.cp, d.tp, d.dp, d.zero_shard, d.grad_dp) == (2, 2, 2, 2, 4, 4, 8)
    assert d.groups("cp")[:2] == [[0, 2], [1, 3]]  # tp-strided neighbours: inside a host with tp
    assert d.zero_groups()[0] == [0, 2, 4, 6]  # one (replicate, tp) index: shard x cp
    assert [d.dp_rank(r) for r in range(0, 16, 2)] == [0, 0, 1, 1, 2, 2, 3, 3]  # cp ranks read one batch
    assert all(d.rank_of(**{str(k): v for k, v in d.coords(r).items() if str(k) != "ep"}) == r for r in range(16))
    assert d.group_size("shard") == 4 and d.group_size("dp") == 8 and d.group_size("cp") == 2
