"""The pipeline planner against measurement: each pp rank's peak in one real pipeline step on gloo.

World 4 as pp 2 x shard 2 and as pp 4 (one spawn each: the pp size is the world's mesh), the tiny
GPT at a batch where activations are about a third of the peak, 1F1B. The planner's per-rank
allocated peak is held to the measured one (storage accounting, zeroshard/planner/measure_pipeline.py)
within 10%, except ZeRO-3 at pp 2 x shard 2, which the plan over-estimates by about 13% (it puts
backward's workspace and the stage's whole gather window on top of every microbatch in flight);
that one is held within 20% and printed.
"""

from __future__ import annotations

import pytest

from zeroshard.launch import spawn
from zeroshard.planner.measure_pipeline import checks, pipeline_measure_worker, request
from zeroshard.planner.pipeline import plan_pipeline

TARGET = 0.10
ZERO3_PP2_TARGET = 0.20
CASES = {"pp2-shard2": dict(pp=2, microbatches=2, stages=(0, 2, 3)), "pp4": dict(pp=4, microbatches=4, stages=(0, 2, 3))}

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def results():
    out = {}
    for name, case in CASES.items():
        pplan = plan_pipeline("tiny", world=4, pp=case["pp"], microbatches=case["microbatches"], batch=8, seq=32,
                              device="cpu")
        per_rank = spawn(pipeline_measure_worker, 4, args=(request(pplan, case["stages"], name="tiny"),),
                         timeout_s=500)
        out[name] = (pplan, checks(pplan, per_rank))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_each_pp_rank_peak_matches_the_plan(results, case):
    pplan, found = results[case]
    assert {c.pp_rank for c in found} == set(range(pplan.shape.pp))
    for c in found:
        print(f"{case} {c.layout} pp rank {c.pp_rank}: predicted {c.predicted / 1e6:.3f} MB, measured "
              f"{c.measured / 1e6:.3f} MB, error {c.error:.1%}")
    for c in found:
        target = ZERO3_PP2_TARGET if (case, c.layout) == ("pp2-shard2", "zero3") else TARGET
        assert c.error <= target, (case, c.layout, c.pp_rank, c.predicted, c.measured)


def test_the_first_stage_holds_the_most(results):
    """1F1B keeps pp microbatches in flight on the first stage, fewer on each later one: measured,
    the first pp rank's peak is the largest of the stages that hold the same blocks' width."""
    pplan, found = results["pp4"]
    ddp = {c.pp_rank: c.measured for c in found if c.layout == "ddp"}
    assert ddp[0] > ddp[1] > ddp[2]
    assert [pplan.ranks[r].in_flight[r] for r in range(4)] == [4, 3, 2, 1]
