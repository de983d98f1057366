"""The pipeline planner against measurement: each pp rank's peak in one real pipeline step on gloo.

World 4 as pp 2 x shard 2 (grads reduced once per step, and at stages 2-3 after every microbatch)
and as pp 4 (one spawn each: the pp size is the world's mesh), the tiny GPT at a batch where
activations are about a third of the peak, 1F1B. The planner's per-rank
allocated peak is held to the measured one (storage accounting, zeroshard/tools/planner/measure_pipeline.py)
within 10% at every stage, layout and rank.
"""

from __future__ import annotations

import pytest

from zeroshard.trainer.launch import spawn
from zeroshard.tools.planner.measure_pipeline import checks, pipeline_measure_many, request
from zeroshard.tools.planner.pipeline import plan_pipeline

TARGET = 0.10
CASES = {"pp2-shard2": dict(pp=2, microbatches=2, stages=(0, 2, 3)),
         "pp2-shard2-microbatch": dict(pp=2, microbatches=2, stages=(2, 3), knobs={"pp_grad_reduce": "microbatch"}),
         "pp2-shard2-checkpointing": dict(pp=2, microbatches=2, stages=(2, 3), knobs={"checkpointing": "all"}),
         "pp4": dict(pp=4, microbatches=4, stages=(0, 2, 3))}
"""pp2-shard2-microbatch reduce-scatters after every microbatch (pp_grad_reduce), and
pp2-shard2-checkpointing checkpoints every block inside each stage; both measured in the pp2-shard2 spawn."""

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def results():
    plans = {name: plan_pipeline("tiny", world=4, pp=case["pp"], microbatches=case["microbatches"], batch=8, seq=32,
                                 device="cpu", **case.get("knobs", {})) for name, case in CASES.items()}
    out = {}
    for pp in sorted({case["pp"] for case in CASES.values()}):  # one spawn per pp layout
        names = [name for name, case in CASES.items() if case["pp"] == pp]
        per_rank = spawn(pipeline_measure_many, 4, args=([request(plans[n], CASES[n]["stages"], name="tiny")
                                                          for n in names],), timeout_s=500)
        for i, name in enumerate(names):
            out[name] = (plans[name], checks(plans[name], [rank[i] for rank in per_rank]))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_each_pp_rank_peak_matches_the_plan(results, case):
    pplan, found = results[case]
    assert {c.pp_rank for c in found} == set(range(pplan.shape.pp))
    for c in found:
        print(f"{case} {c.layout} pp rank {c.pp_rank}: predicted {c.predicted / 1e6:.3f} MB, measured "
              f"{c.measured / 1e6:.3f} MB, error {c.error:.1%}")
    for c in found:
        assert c.error <= TARGET, (case, c.layout, c.pp_rank, c.predicted, c.measured)


def test_grad_reduce_per_microbatch_lowers_the_last_stage_peak(results):
    """The last pp rank (one microbatch in flight under 1F1B) peaks once its grads are carried: full
    under "step", the 1/N shard plus the units whose reductions are in flight under "microbatch".
    Planned lower at zero2 and zero3; measured lower at zero3 (one unit per block). At zero2 the tiny
    stage's two measured peaks differ by about 1% only, so only the plan is compared there."""
    once, per_mb = results["pp2-shard2"], results["pp2-shard2-microbatch"]
    for layout in ("zero2", "zero3"):
        measured = {c.pp_rank: c.measured for c in once[1] if c.layout == layout}
        for c in (c for c in per_mb[1] if c.layout == layout):
            print(f"{layout} pp rank {c.pp_rank}: measured {measured[c.pp_rank] / 1e6:.3f} MB reducing once per step, "
                  f"{c.measured / 1e6:.3f} MB per microbatch (planned {c.predicted / 1e6:.3f} MB)")
        assert per_mb[0].ranks[1].plan[layout].device.allocated < once[0].ranks[1].plan[layout].device.allocated
    last = next(c for c in per_mb[1] if c.layout == "zero3" and c.pp_rank == 1)
    assert last.measured < next(c.measured for c in once[1] if c.layout == "zero3" and c.pp_rank == 1)


def test_the_first_stage_holds_the_most(results):
    """1F1B keeps pp microbatches in flight on the first stage, fewer on each later one: measured,
    the first pp rank's peak is the largest of the stages that hold the same blocks' width."""
    pplan, found = results["pp4"]
    ddp = {c.pp_rank: c.measured for c in found if c.layout == "ddp"}
    assert ddp[0] > ddp[1] > ddp[2]
    assert [pplan.ranks[r].in_flight[r] for r in range(4)] == [4, 3, 2, 1]
