"""The step schedule as a pure function: its rules on hand-made unit sizes, without a process group.

tests/distributed/test_schedule.py checks it against the ledger of real steps, op by op; these
check the rules it states (docs/runtime.md, "The step schedule") on sizes worked out here.
"""

from __future__ import annotations

import collections

import pytest
import torch

from zeroshard.comm.quant import CommQuant, wire_bytes
from zeroshard.tools.planner.comm import schedule_rows
from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.options import EngineOptions
from zeroshard.runtime.schedule import step_schedule
from zeroshard.comm.dims import ParallelDims
from zeroshard.runtime.schedule_events import GroupSizes, UnitSizes

BLOCK, ROOT = 50_176, 20_608  # tiny's padded flat buffers at world 2 and 4
NAMES = ["blocks.3", "blocks.2", "blocks.1", "blocks.0"]  # the engine's reduction order


def units(shards: int, dtype: torch.dtype = torch.float32) -> list[UnitSizes]:
    def group(numel: int) -> GroupSizes:
        return GroupSizes(numel=numel, shard_numel=numel // shards, compute_dtype=dtype)
    return [UnitSizes(name=n, groups=(group(BLOCK),)) for n in NAMES] + \
        [UnitSizes(name="<root>", is_root=True, groups=(group(ROOT),))]


def schedule(stage: int, world: int = 2, shard: int | None = None, **kw):
    shard = shard or world
    return step_schedule(units(shard if stage else 1), policy=StagePolicy(stage), mesh=ParallelDims.of(world, shard=shard),
                         **kw)


def test_stage3_gathers_every_unit_in_forward_and_all_but_root_and_last_block_in_backward():
    s = schedule(3)
    gathers = [(e.unit, e.phase) for e in s.collectives if e.op == "all_gather"]
    assert gathers == [("<root>", "forward"), ("blocks.0", "forward"), ("blocks.1", "forward"),
                       ("blocks.2", "forward"), ("blocks.3", "forward"),
                       ("blocks.2", "backward"), ("blocks.1", "backward"), ("blocks.0", "backward")]
    # Each prefetch is issued before the reduction of the unit that issued it.
    order = [(e.op, e.unit) for e in s.collectives]
    for later, earlier in zip(NAMES, NAMES[1:]):
        assert order.index(("all_gather", earlier)) < order.index(("reduce_scatter", later))
    assert [e.unit for e in s.collectives if e.op == "reduce_scatter"] == NAMES + ["<root>"]
    # Frees: blocks 0-2 after their forward, the kept block 3 and the others after their grads, the root last.
    assert [(e.unit, e.phase) for e in s.frees][-1] == ("<root>", "forward")
    assert sum(e.op == "free" for e in s.events) == 4 + 4 + 1 - 1


def test_the_first_step_regathers_the_last_block_and_prefetches_nothing_ahead():
    options = EngineOptions(prefetch=2)
    steady, first = schedule(3, options=options), schedule(3, options=options, first_step=True)
    extra = collections.Counter(e.key for e in first.collectives) - collections.Counter(e.key for e in steady.collectives)
    assert list(extra) == [("all_gather", "shard", "blocks.3", "backward", BLOCK, "float32")]
    assert len(first.collectives) == len(steady.collectives) + 1


def test_without_resharding_stage3_gathers_once():
    s = schedule(3, options=EngineOptions(reshard_after_forward=False))
    assert {e.phase for e in s.collectives if e.op == "all_gather"} == {"forward"}


@pytest.mark.parametrize("stage, op, group", [(0, "all_reduce", "world"), (1, "reduce_scatter", "shard"),
                                              (2, "reduce_scatter", "shard")])
def test_stages_0_2_reduce_each_bucket_once_per_step_or_per_micro_step(stage, op, group):
    buckets = [UnitSizes(name="a", groups=(GroupSizes(numel=4096, shard_numel=4096 // (2 if stage else 1)),)),
               UnitSizes(name="b", is_root=True, groups=(GroupSizes(numel=2048, shard_numel=2048 // (2 if stage else 1)),))]
    for accumulation, per_micro in (("sharded", stage == 2), ("unsharded", False)):
        s = step_schedule(buckets, policy=StagePolicy(stage), mesh=ParallelDims.of(2, shard=2), accum=3,
                          options=EngineOptions(accumulation=accumulation))
        reductions = [(e.micro, e.unit) for e in s.collectives if e.op == op]
        assert reductions == ([(m, u) for m in range(3) for u in "ab"] if per_micro else [(2, "a"), (2, "b")])
        assert {e.group for e in s.collectives if e.op == op} == {group}
        gathers = [e for e in s.collectives if e.op == "all_gather"]
        assert [(e.unit, e.phase) for e in gathers] == ([("a", "param_sync"), ("b", "param_sync")] if stage else [])


def test_hybrid_finishes_the_oldest_reduction_past_the_cap_and_the_rest_at_the_step():
    s = schedule(2, world=4, shard=2)  # (stage 2 with one bucket per unit: the units are the engine's buckets)
    ops = [(e.op, e.group, e.unit) for e in s.collectives]
    replicated = [u for op, g, u in ops if g == "replicate"]
    assert replicated == NAMES + ["<root>"]  # in reduction order, each after its reduce-scatter
    # Two reductions may be pending: the third launch finishes the first.
    assert ops.index(("all_reduce", "replicate", "blocks.3")) == ops.index(("reduce_scatter", "shard", "blocks.1")) + 1
    # The last two finish when the optimizer reads them, before the stage-2 param all-gathers.
    assert ops.index(("all_reduce", "replicate", "<root>")) < ops.index(("all_gather", "shard", "blocks.3"))
    shard_numel = {e.unit: e.numel for e in s.collectives if e.group == "replicate"}
    assert shard_numel == {**{n: BLOCK // 2 for n in NAMES}, "<root>": ROOT // 2}


def test_quantized_weights_and_grads_go_as_int8_plus_scales():
    comm = CommQuant(weights=True, grads=True, block_size=128)
    s = schedule(3, comm=comm)
    forward = [e for e in s.collectives if e.phase == "forward"]
    assert [(e.unit, e.dtype) for e in forward[:3]] == [("<root>", "float32"), ("blocks.0", "int8"),
                                                        ("blocks.0", "float32")]
    pair = [e.bytes for e in forward if e.unit == "blocks.0"]
    assert sum(pair) == 2 * wire_bytes(BLOCK // 2, 128) and all(e.quantized for e in forward[1:3])
    grads = [e for e in s.collectives if e.op == "all_to_all"]
    assert [e.unit for e in grads][::2] == NAMES + ["<root>"]
    assert not [e for e in s.collectives if e.op == "reduce_scatter"]


def test_checkpoint_segments_rebuild_from_the_segments_first_unit():
    # every:3 over 4 blocks: [0, 3) and [3, 4). blocks.0 is sharded when blocks.2's backward
    # rebuilds the segment, so the recompute gathers it (and it stays gathered to its own backward).
    s = schedule(3, options=EngineOptions(checkpointing="every:3"))
    assert [(e.unit, e.phase) for e in s.collectives if e.phase == "recompute"] == [("blocks.0", "recompute")]
    assert ("blocks.0", "recompute") in [(e.unit, e.phase) for e in s.frees]


def test_planner_rows_sum_the_schedule():
    mesh = ParallelDims.of(4, shard=2)
    s = schedule(3, world=4, shard=2, accum=2)
    rows = schedule_rows(s, mesh)
    totals: dict[tuple[str, str], int] = {}
    for r in rows:
        totals[(r.op, r.group)] = totals.get((r.op, r.group), 0) + r.buffer_bytes * r.count
    assert totals == s.bytes_by()
    forward = next(r for r in rows if r.op == "all_gather" and r.phase == "forward")
    assert (forward.count, forward.buffer_bytes, forward.size) == (2, 4 * (4 * BLOCK + ROOT), 2)


def test_bad_inputs():
    with pytest.raises(ValueError, match="accum"):
        schedule(3, accum=0)
    with pytest.raises(ValueError, match="shard_size=3 does not divide the 4 data-parallel ranks"):
        ParallelDims.of(4, shard=3)


@pytest.mark.parametrize("prefetch, reshard, checkpointing, blocks_held", [
    (1, True, "none", 2),        # a block computing and the one prefetched after it
    (2, True, "none", 3),
    (0, True, "none", 1),        # on demand: each block is freed before the next one is gathered
    (1, False, "none", 4),       # every block gathered from its forward to its backward
    (1, True, "every:4", 4),     # one segment of all four blocks rebuilt at once in backward
])
def test_peak_gathered_bytes_is_the_root_and_the_blocks_gathered_at_once(prefetch, reshard, checkpointing,
                                                                          blocks_held):
    """The all-gather window the planner reads: the root stays gathered for the whole step, and the
    blocks held at once follow prefetch, resharding and checkpoint segments (4 bytes per fp32 element)."""
    options = EngineOptions(prefetch=prefetch, reshard_after_forward=reshard, checkpointing=checkpointing)
    assert schedule(3, options=options).peak_gathered_bytes(units(2)) == 4 * (ROOT + blocks_held * BLOCK)
    # Stages 0-2 keep full params resident, and one shard gathers nothing: no window either way.
    assert schedule(2).peak_gathered_bytes(units(2)) == 0
    assert schedule(3, world=1, options=options).peak_gathered_bytes(units(1)) == 0


@pytest.mark.parametrize("prefetch, reshard, accum, blocks_held", [
    (1, True, 1, 1),    # the last forward block is kept for backward; the next is prefetched only after its start
    (2, True, 1, 1),
    (1, False, 1, 4),   # nothing was resharded in forward
    (1, True, 2, 1),    # every micro-step's backward starts the same way
])
def test_backward_starts_with_what_forward_left_gathered(prefetch, reshard, accum, blocks_held):
    """The window next to every saved activation, which the planner's backward-start moment reads:
    the root and the blocks forward did not free, before backward's first prefetch."""
    options = EngineOptions(prefetch=prefetch, reshard_after_forward=reshard)
    s = schedule(3, options=options, accum=accum)
    assert s.gathered_at_backward_start(units(2)) == 4 * (ROOT + blocks_held * BLOCK)
    assert s.gathered_at_backward_start(units(2)) <= s.peak_gathered_bytes(units(2))
    assert schedule(2).gathered_at_backward_start(units(2)) == 0


SCHEDULED_KNOBS = {"prefetch": (0, 2), "reshard_after_forward": (True, False), "max_inflight_reductions": (0, 4),
                   "accumulation": ("sharded", "unsharded")}
"""Knobs the schedule models, each with two values that change it wherever the engine reads the knob."""


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("knob", sorted(SCHEDULED_KNOBS))
def test_a_knob_changes_the_step_exactly_where_the_stage_policy_says_the_engine_reads_it(stage, knob):
    # Hybrid (4 ranks, shards of 2) and two micro-steps, so that finishing reductions and
    # accumulating show up as collectives of their own.
    a, b = (schedule(stage, world=4, shard=2, accum=2, options=EngineOptions.from_flat({knob: v}))
            for v in SCHEDULED_KNOBS[knob])
    assert (a.events != b.events) == StagePolicy(stage).reads(knob)


# -- the marks: where compute runs and where the step blocks -------------------------------------

@pytest.mark.parametrize("stage", (0, 1, 2, 3))
@pytest.mark.parametrize("checkpointing", ("none", "every:2"))
def test_every_unit_computes_one_forward_and_one_backward_per_micro_step(stage, checkpointing):
    """The compute marks' shares add up to one forward and one backward of each unit per
    micro-step (at stages 0-2 of the model outside its buckets, and of each bucket's backward), a
    rebuild for each block of a checkpoint segment at stage 3, and one update."""
    accum = 2
    s = schedule(stage, world=4, shard=2, accum=accum, options=EngineOptions(checkpointing=checkpointing))
    shares: collections.Counter = collections.Counter()
    for e in s.events:
        if e.op == "compute":
            shares[(e.unit, e.phase)] += e.share
    if stage == 3:
        expected = {(n, p): accum for n in NAMES + ["<root>"] for p in ("forward", "backward")}
        if checkpointing != "none":  # segments of two blocks: all four rebuilt
            expected |= {(n, "recompute"): accum for n in NAMES}
    else:
        expected = {("", "forward"): accum, ("", "backward"): accum} | {(u.name, "backward"): accum for u in units(1)}
    optimizer = sum(v for (_, phase), v in shares.items() if phase == "optimizer")
    assert optimizer == pytest.approx(1.0)
    assert {k: pytest.approx(v) for k, v in shares.items() if k[1] != "optimizer"} == expected


@pytest.mark.parametrize("options", (EngineOptions(), EngineOptions(prefetch=2), EngineOptions(checkpointing="every:2"),
                                     EngineOptions(reshard_after_forward=False)))
def test_stage3_computes_a_unit_only_after_waiting_for_its_latest_gather(options):
    """Every all-gather of a unit is waited on before that unit's next compute mark, as the engine's
    pre-forward, pre-backward and rebuild hooks wait (``Unit.wait_unshard``); a prefetch is issued
    only after the unit that issued it has its own params."""
    s = schedule(3, world=4, accum=2, options=options)
    unwaited: set[str] = set()
    for e in s.events:
        if e.op == "all_gather":
            unwaited.add(e.unit)
        elif e.op == "wait":
            unwaited.discard(e.unit)
        elif e.op == "compute" and e.phase != "optimizer":
            assert e.unit not in unwaited, f"{e.unit} computes {e.phase} before waiting for its gather"


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_every_reduction_is_waited_on_before_the_step_ends(stage):
    """Each launched reduction (and, on a hybrid mesh, each replica all-reduce) is followed by a wait
    for its unit, the replica all-reduce between the two waits of a finish."""
    s = schedule(stage, world=4, shard=2, accum=2)
    open_units: collections.Counter = collections.Counter()
    for e in s.events:
        if e.is_collective and e.op != "all_gather":
            open_units[e.unit] += 1
        elif e.op == "wait":
            open_units.pop(e.unit, None)
    assert not open_units
    assert s.issued == tuple(e for e in s.events if e.op not in ("compute", "wait"))
