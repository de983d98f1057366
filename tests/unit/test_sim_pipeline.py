"""The pipeline replay: torch's order walked with unit times gives the textbook bubble when every
stage takes the same time, and the step holds each rank's reduction and update after its schedule."""

from __future__ import annotations

import pytest

from zeroshard.models import GPTConfig
from zeroshard.parallel.pipeline.order import bubble_fraction, schedule_order
from zeroshard.tools.sim.hardware import load_hardware
from zeroshard.parallel.pipeline.replay import StageTimes, equal_time_bubble, replay_order
from zeroshard.tools.sim.pipeline import simulate_pipeline
from zeroshard.tools.sim.step import Layout
from zeroshard.tools.sim.workload import Workload, gpt_shape


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 4, 8, 1), ("1f1b", 2, 2, 1), ("1f1b", 4, 8, 1),
                                             ("1f1b", 4, 4, 1), ("interleaved-1f1b", 2, 4, 2),
                                             ("interleaved-1f1b", 4, 8, 2)])
def test_equal_stages_idle_the_textbook_bubble(schedule, pp, m, v):
    order = schedule_order(schedule, pp=pp, stages_per_rank=v, microbatches=m)
    walked = replay_order(order, _equal(pp * v), p2p=0.0)
    span = max(end for end, _ in walked.values())
    for end, busy in walked.values():
        assert busy == pytest.approx(3.0 * m * v)
        assert 1 - busy / span == pytest.approx(bubble_fraction(pp=pp, microbatches=m, stages_per_rank=v))
    assert equal_time_bubble(schedule, pp=pp, stages_per_rank=v, microbatches=m) == pytest.approx(
        bubble_fraction(pp=pp, microbatches=m, stages_per_rank=v))


def _equal(n: int) -> StageTimes:
    return StageTimes([1.0] * n, [2.0] * n, [1.0] * n)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16)])
def test_zero_bubble_fills_interleaved_1f1bs_bubble_with_weight_halves(pp, m):
    """torch's ZB1P order splits every backward into I then W on the same stage; with equal stages
    every rank still does all its work (3 per microbatch and stage) but idles less than interleaved 1F1B."""
    order = schedule_order("interleaved-zero-bubble", pp=pp, stages_per_rank=2, microbatches=m)
    for actions in order.values():
        seen = [(a.kind, a.stage, a.microbatch) for a in actions]
        assert not any(k == "B" for k, _, _ in seen)
        for k, s, j in seen:
            if k == "W":
                assert seen.index(("I", s, j)) < seen.index((k, s, j))
    walked = replay_order(order, _equal(2 * pp), p2p=0.0)
    # The first stage's I is empty and its W the whole backward: busy is still 3 per microbatch and stage.
    assert all(busy == pytest.approx(3.0 * m * 2) for _, busy in walked.values())
    zb = equal_time_bubble("interleaved-zero-bubble", pp=pp, stages_per_rank=2, microbatches=m)
    assert 0 < zb < bubble_fraction(pp=pp, microbatches=m, stages_per_rank=2)


def test_more_microbatches_shrink_the_bubble_and_the_link_delays_the_step():
    hw = load_hardware("h100")
    w = Workload(shape=gpt_shape(GPTConfig.named("small", seq_len=256), "small"), micro_batch=1, seq=256)
    layout = Layout.of(world=2, stage=2)
    runs = [simulate_pipeline(w, hw, layout, pp=4, microbatches=m) for m in (4, 8, 16)]
    assert runs[0].bubble > runs[1].bubble > runs[2].bubble
    # Every rank's step ends with its own reduction and update: the step is no shorter than any rank's.
    for r in runs:
        assert r.step_s == pytest.approx(max(x.schedule_s + x.tail_s for x in r.ranks))
        assert all(x.tail_s > 0 for x in r.ranks)
    import dataclasses

    slow = dataclasses.replace(hw, intra_latency=hw.intra_latency + 1e-3, inter_latency=hw.inter_latency + 1e-3)
    assert simulate_pipeline(w, slow, layout, pp=4, microbatches=4).step_s > runs[0].step_s


def test_a_split_the_blocks_do_not_take_is_refused():
    w = Workload(shape=gpt_shape(GPTConfig.named("tiny"), "tiny"), micro_batch=1, seq=64)
    with pytest.raises(ValueError, match="3 pipeline stages do not divide the model's 4 blocks"):
        simulate_pipeline(w, load_hardware("h100"), Layout.of(world=1, stage=0), pp=3, microbatches=3)
    with pytest.raises(ValueError, match="needs at least pp=2 microbatches"):
        simulate_pipeline(w, load_hardware("h100"), Layout.of(world=1, stage=0), pp=2, microbatches=1)


def test_ranks_sharing_cores_slow_down_only_while_more_run_than_there_are_cores():
    order = schedule_order("gpipe", pp=4, stages_per_rank=1, microbatches=4)
    own = replay_order(order, _equal(4), p2p=0.0)
    assert replay_order(order, _equal(4), p2p=0.0, cores=4) == own
    one = replay_order(order, _equal(4), p2p=0.0, cores=1)
    # One core runs one action at a time: the step is at least all the work, one after the other.
    assert max(end for end, _ in one.values()) >= 4 * 4 * 3.0 - 1e-9
    assert max(end for end, _ in one.values()) > max(end for end, _ in own.values())


def test_plan_time_pp_replays_each_stage(capsys):
    import json

    from zeroshard.cli.main import main

    argv = ["plan", "--time", "--model", "small", "--world", "8", "--pp", "4", "--batch", "16", "--seq", "256",
            "--json"]
    assert main([*argv, "--microbatches", "4"]) == 0
    few = json.loads(capsys.readouterr().out)
    assert main([*argv, "--microbatches", "8"]) == 0
    many = json.loads(capsys.readouterr().out)
    assert set(few["rows"]) == {"0", "1", "2", "3"}
    assert few["workload"]["micro_batch"] == 2 and many["workload"]["micro_batch"] == 1
    for stage in few["rows"]:
        assert many["rows"][stage]["bubble"] < few["rows"][stage]["bubble"]
        assert len(few["rows"][stage]["ranks"]) == 4


def test_a_stages_data_parallel_ranks_share_the_cores_with_their_pipeline():
    """dp pipelines run side by side, each rank of a stage doing the same action at the same moment:
    on shared cores one pipeline gets cores / (ranks per stage) of them."""
    hw = load_hardware("h100")
    w = Workload(shape=gpt_shape(GPTConfig.named("small", seq_len=128), "small"), micro_batch=1, seq=128)
    layout = Layout.of(world=2, stage=2)
    own = simulate_pipeline(w, hw, layout, pp=2, microbatches=4)
    enough = simulate_pipeline(w, hw, layout, pp=2, microbatches=4, cores=4)  # a core for each of the 4 ranks
    shared = simulate_pipeline(w, hw, layout, pp=2, microbatches=4, cores=2)
    assert [r.schedule_s for r in enough.ranks] == pytest.approx([r.schedule_s for r in own.ranks])
    assert all(s.schedule_s > e.schedule_s for s, e in zip(shared.ranks, enough.ranks))



def test_zero3_gathers_per_action_are_the_stage_engines_step_schedule_in_torchs_order():
    """At pp 2, 1F1B, m 2, two blocks a stage: the first rank runs F0 F1 B0 B1, so its second
    forward finds the last block still kept from the first (one gather), B0 prefetches one block
    and B1, after B0 freed everything, gathers both; the last rank alternates F B F B, as a
    micro-step does. The replay's stage 3 step then waits less on rank 0's second forward."""
    from zeroshard.tools.sim.pipeline import _block_gathers

    w = Workload(shape=gpt_shape(GPTConfig.named("tiny"), "tiny"), micro_batch=1, seq=64)
    layout = Layout.of(world=2, stage=3)
    order = schedule_order("1f1b", pp=2, stages_per_rank=1, microbatches=2)
    assert _block_gathers(w, layout, order, 2, 2) == {
        ("F", 0, 0): 2, ("F", 0, 1): 1, ("B", 0, 0): 1, ("B", 0, 1): 2,
        ("F", 1, 0): 2, ("B", 1, 0): 1, ("F", 1, 1): 2, ("B", 1, 1): 1}
    # Gathers slow a slow link's step, and stage 2 gathers nothing.
    slow = load_hardware("h100")
    import dataclasses as dc

    slow = dc.replace(slow, intra_bandwidth=slow.intra_bandwidth / 1000, inter_bandwidth=slow.inter_bandwidth / 1000)
    zero3 = simulate_pipeline(w, slow, layout, pp=2, microbatches=2)
    zero2 = simulate_pipeline(w, slow, Layout.of(world=2, stage=2), pp=2, microbatches=2)
    assert zero3.step_s > zero2.step_s


def test_zero_bubble_halves_gather_what_the_stage_engine_gathers():
    """Interleaved zero-bubble at pp 2 (stages 0 and 2 on rank 0, one block each), m 4: stage 2's
    input half finds the block its forward kept (I0, I2 gather nothing) and each weight half
    gathers it again; the first stage runs each weight half as one whole backward, whose first
    finds the block and root still kept from forward. (The same counts as a gloo run's ledger:
    tests/distributed/test_pp.py holds the schedule to it.)"""
    from zeroshard.tools.sim.pipeline import _block_gathers

    w = Workload(shape=gpt_shape(GPTConfig.named("tiny"), "tiny"), micro_batch=1, seq=64)
    order = schedule_order("interleaved-zero-bubble", pp=2, stages_per_rank=2, microbatches=4)
    got = _block_gathers(w, Layout.of(world=2, stage=3), order, 1, 2)
    assert {k: n for k, n in got.items() if k[1] == 0} == {("F", 0, 0): 1, ("B", 0, 1): 1, ("B", 0, 2): 1,
                                                             ("B", 0, 3): 1}
    assert {k: n for k, n in got.items() if k[1] == 2} == {
        ("F", 2, 0): 1, ("W", 2, 0): 1, ("I", 2, 1): 1, ("W", 2, 1): 1, ("F", 2, 2): 1, ("W", 2, 2): 1,
        ("I", 2, 3): 1, ("W", 2, 3): 1}


def test_tails_share_the_cores_with_what_still_runs():
    """Two ranks on one core: the first rank's tail runs while the second still computes, so both
    advance at half speed; alone, a tail takes its own seconds."""
    order = schedule_order("1f1b", pp=2, stages_per_rank=1, microbatches=2)
    alone: dict[int, float] = {}
    replay_order(order, _equal(2), p2p=0.0, tails={0: 1.0, 1: 1.0}, finished=alone)
    walked = replay_order(order, _equal(2), p2p=0.0)
    assert all(alone[r] == pytest.approx(walked[r][0] + 1.0) for r in walked)
    shared: dict[int, float] = {}
    on_one = replay_order(order, _equal(2), p2p=0.0, cores=1, tails={0: 1.0, 1: 1.0}, finished=shared)
    # rank 1 ends its schedule first; its tail overlaps rank 0's last backward
    assert shared[1] - on_one[1][0] > 1.0
    assert max(shared.values()) > max(alone.values())
