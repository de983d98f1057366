"""The planner against measurement, one real step per stage on gloo at world 2.

- `small`, stages 0-3, every component predicted within 2% (the plan's own accounting);
- the checkpointing × offload matrix, {none, sqrt, every:2} × {none, cpu}, each pair at two stages
  so that every stage meets every policy and both offloads (a pairwise cover of the 24 cases, in
  12 measured steps): model states within 10%, the peak within 25%, the offloaded bytes and the
  kept checkpoint inputs as predicted. The two pairs without checkpointing run without clipping.
  The matrix runs 5 blocks (so sqrt's 3+2 segments differ from every:2's 2+2+1) at a quarter of
  small's width.

One spawn for the whole module (a gloo world costs seconds per process here); the worker runs every
plan and stage one after the other on fresh models and returns plain numbers.
"""

from __future__ import annotations

import pytest

from zeroshard.trainer.launch import spawn
from zeroshard.models import GPTConfig
from zeroshard.tools.planner import plan
from zeroshard.tools.planner.measure import MEASURED, checks, measure_many_worker, request

WORLD = 2
STAGES = (0, 1, 2, 3)
MODEL_STATE_TARGET = 0.10
TOTAL_TARGET = 0.25
POLICIES = ("none", "sqrt", "every:2")
OFFLOADS = ("none", "cpu")
MATRIX_MODEL = GPTConfig.named("small", n_layer=5, n_embd=128, n_head=4)
MATRIX = [(ckpt, off) for ckpt in POLICIES for off in OFFLOADS]
MATRIX_STAGES = {("none", "none"): (0, 3), ("sqrt", "cpu"): (0, 3), ("every:2", "cpu"): (0, 3),
                 ("none", "cpu"): (1, 2), ("sqrt", "none"): (1, 2), ("every:2", "none"): (1, 2)}
"""Each (policy, offload) pair's stages: every stage meets every policy and both offloads."""
UNCLIPPED = {("none", "none"), ("none", "cpu")}
"""Pairs planned and run without clipping (train's default clips): every stage once, both offloads,
with no float64 norm chunk in the step."""

# The module's one spawn measures 16 steps; on a loaded two-core machine that outlasts the default
# per-test timeout, which the first test pays for.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def planned():
    # Global batch 2 = one sequence of 128 tokens per rank: activations are a real share of the
    # total (about 10%) while each stage's step stays around a second on two cores.
    return plan("small", world=WORLD, batch=2, seq=128, device="cpu")


@pytest.fixture(scope="module")
def matrix_plans():
    return {key: plan(MATRIX_MODEL, world=WORLD, batch=2, seq=32, device="cpu", checkpointing=key[0],
                      offload=key[1], **({"clip": 0.0} if key in UNCLIPPED else {})) for key in MATRIX}


@pytest.fixture(scope="module")
def spawned(planned, matrix_plans):
    reqs = [request(planned, STAGES)] + [request(matrix_plans[key], MATRIX_STAGES[key]) for key in MATRIX]
    return spawn(measure_many_worker, WORLD, args=(reqs,), timeout_s=900)


@pytest.fixture(scope="module")
def result(planned, spawned):
    out = checks(planned, [r[0] for r in spawned])
    for c in out:  # the table for the log (pytest -s)
        print(f"{c.layout}: model states {c.predicted.model_states} vs "
              f"{sum(c.measured[k] for k in ('params', 'grads', 'master', 'optimizer'))}, "
              f"allocated {c.predicted.allocated} vs {c.measured_total} ({c.total_error:.1%}); " +
              ", ".join(f"{k} {getattr(c.predicted, k)} vs {c.measured[k]}" for k in MEASURED) +
              f", workspace-overlap {c.predicted.workspace - c.predicted.overlap} vs {c.measured['workspace']}")
    return {c.layout: c for c in out}


@pytest.fixture(scope="module")
def matrix(matrix_plans, spawned):
    out = {}
    for i, key in enumerate(MATRIX, start=1):
        out[key] = {c.layout: c for c in checks(matrix_plans[key], [r[i] for r in spawned])}
        for c in out[key].values():
            print(f"{key[0]:>8} {key[1]:>4} {c.layout:>13}: model states {c.model_state_error:6.1%}, "
                  f"peak {c.predicted_peak / 1e6:7.2f} vs {c.measured_total / 1e6:7.2f} MB ({c.total_error:6.1%}), "
                  f"host {c.predicted_host / 1e6:6.2f} vs {c.measured_host / 1e6:6.2f} MB")
    return out


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


@pytest.mark.parametrize("key", MATRIX, ids=[f"{c}-{o}" for c, o in MATRIX])
def test_checkpointing_and_offload_within_target(matrix, key):
    assert len(matrix[key]) == len(MATRIX_STAGES[key])
    for name, check in matrix[key].items():
        assert check.model_state_error <= MODEL_STATE_TARGET, name
        assert check.total_error <= TOTAL_TARGET, name


@pytest.mark.parametrize("key", MATRIX, ids=[f"{c}-{o}" for c, o in MATRIX])
def test_offloaded_bytes_and_kept_inputs_are_as_planned(matrix, matrix_plans, key):
    """Offloaded masters, optimizer state and grad shards are read from their storages; the
    activations kept for backward are the saved tensors plus each checkpoint segment's input."""
    saved = matrix_plans[key].activations.saved
    for name, check in matrix[key].items():
        assert check.predicted_kept == saved
        assert check.measured_host == pytest.approx(check.predicted_host, rel=0.02), name
        assert (check.measured_host > 0) == (key[1] != "none"), name
        assert check.measured["activations"] == pytest.approx(saved, rel=0.02), name
        for comp in ("params", "grads", "master", "optimizer", "window"):
            assert check.measured[comp] == pytest.approx(getattr(check.predicted, comp), rel=0.02, abs=16 * 1024), \
                (name, comp)


def test_the_matrix_covers_every_stage_with_every_policy_and_offload():
    for stage in STAGES:
        met = [key for key in MATRIX if stage in MATRIX_STAGES[key]]
        assert {c for c, _ in met} == set(POLICIES) and {o for _, o in met} == set(OFFLOADS)


def test_measure_refuses_disk_offload_with_the_reason():
    disk = plan("tiny", world=WORLD, offload="disk", device="cpu")
    with pytest.raises(ValueError, match="memory-mapped files"):
        request(disk, STAGES)
