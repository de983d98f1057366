"""The planner against measurement: `small` at world 2, stages 0-3, one real step each on gloo.

One spawn for the whole module (a gloo world costs seconds per process here); the worker runs the
four stages one after the other on fresh models and returns plain numbers.
"""

from __future__ import annotations

import pytest

from zeroshard.plan import plan
from zeroshard.plan.measure import MEASURED, checks, measure_worker, request
from zeroshard.plan.memory import MAX_INFLIGHT_REDUCTIONS
from zeroshard.launch import spawn

WORLD = 2
STAGES = (0, 1, 2, 3)
MODEL_STATE_TARGET = 0.10
TOTAL_TARGET = 0.25


@pytest.fixture(scope="module")
def planned():
    # Global batch 2 = one sequence of 128 tokens per rank: activations are a real share of the
    # total (about 10%) while each stage's step stays around a second on two cores.
    return plan("small", world=WORLD, batch=2, seq=128, device="cpu")


@pytest.fixture(scope="module")
def per_rank(planned):
    return spawn(measure_worker, WORLD, args=(request(planned, STAGES),), timeout_s=240)


@pytest.fixture(scope="module")
def result(planned, per_rank):
    out = checks(planned, per_rank)
    for c in out:  # the table for the log (pytest -s)
        print(f"{c.layout}: model states {c.predicted.model_states} vs "
              f"{sum(c.measured[k] for k in ('params', 'grads', 'master', 'optimizer'))}, "
              f"allocated {c.predicted.allocated} vs {c.measured_total} ({c.total_error:.1%})")
    return {c.layout: c for c in out}


@pytest.mark.parametrize("layout", ["ddp", "zero1", "zero2", "zero3"])
def test_model_states_within_target(result, layout):
    assert result[layout].model_state_error <= MODEL_STATE_TARGET


@pytest.mark.parametrize("layout", ["ddp", "zero1", "zero2", "zero3"])
def test_total_within_target(result, layout):
    assert result[layout].total_error <= TOTAL_TARGET


@pytest.mark.parametrize("layout", ["ddp", "zero1", "zero2", "zero3"])
def test_each_component_is_predicted(result, layout):
    """Storage accounting reads exactly what the runtime allocated; the plan should say the same
    per component, not only in sum (a right total from two wrong terms would be luck)."""
    check = result[layout]
    for comp in MEASURED:
        predicted, measured = getattr(check.predicted, comp), check.measured[comp]
        assert predicted == pytest.approx(measured, rel=0.02, abs=64 * 1024), comp


def test_stage3_window_is_one_plus_prefetch_blocks_plus_root(result, planned):
    check = result["zero3"]
    assert check.measured["window"] > 0
    assert check.measured["window"] == check.predicted.window


def test_plan_assumes_the_engines_cap_on_inflight_reductions(per_rank):
    """Stages 2-3's buckets are a bound set by how many reductions the engine lets run while the next
    unit collects its grads; a different cap needs the plan's constant changed with it."""
    engine = {r[s]["max_inflight_reductions"] for r in per_rank for s in (2, 3)}
    assert engine == {MAX_INFLIGHT_REDUCTIONS}, (
        f"the engine's max_inflight_reductions is {engine}: set zeroshard.plan.memory.MAX_INFLIGHT_REDUCTIONS")


def test_measure_refuses_planned_only_features():
    sqrt = plan("tiny", world=WORLD, checkpointing="sqrt", device="cpu")
    with pytest.raises(ValueError, match="planned only"):
        request(sqrt, STAGES)
