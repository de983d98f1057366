"""Runs that heal: a non-finite step skipped on every rank by agreement, bitwise as if its batch
had never come, diagnosed to the rank and unit (K in a row stopping the run: tests/e2e/test_heal_cli.py);
a loss spike rolled back to the last checkpoint with its data window skipped, and reproduced by a rerun."""

from __future__ import annotations

import pytest

import heal_workloads as w
from zeroshard.trainer.heal import SpikeWatch
from zeroshard.trainer.launch import spawn


@pytest.fixture(scope="module")
def guard_runs(tmp_path_factory):
    return spawn(w.guard_suite, 2, args=(str(tmp_path_factory.mktemp("guard")),), timeout_s=420)


@pytest.mark.parametrize("case", [("train", "fp32"), ("train", "bf16"), ("user", "fp32"), ("user", "bf16"),
                                  ("user-noclip", "fp32")])
def test_nan_step_is_skipped_on_every_rank_as_if_its_batch_never_came(guard_runs, case):
    print(f"guard suite: {max(o['cpu_s'] for o in guard_runs):.1f} s CPU per rank")
    for rank, out in enumerate(guard_runs):
        r = out[case]
        assert r["equal_before"], (rank, case)
        assert r["bad_step_changed_nothing"], (rank, case)  # the update was skipped on this rank
        assert r["equal_after"], (rank, case)  # bitwise the run that never saw step 5's batch
        assert r["trained_after"] and r["finite"], (rank, case)
        if r["skipped"] is not None:
            assert r["skipped"] == [False] * (w.BAD_STEP - 1) + [True, False]
        report = r["report"]
        assert report["skipped_steps"] == 1 and report["consecutive"] == 0
        skip = report["skips"][0]
        assert (skip["step"], skip["first_rank"], skip["first_unit"]) == (w.BAD_STEP, 1, "blocks.0")


def test_spike_rolls_back_skips_its_window_and_a_rerun_reproduces_it(tmp_path):
    first_rank = spawn(w.rollback_suite, 2, args=(str(tmp_path),), timeout_s=420)
    for out in first_rank:
        first, again = out["first"], out["again"]
        (rb,) = first["rollbacks"]
        assert (rb["step"], rb["restored_step"]) == (w.SPIKE_STEP, 6)
        assert rb["skipped_batches"] == [[0, 6], [0, 7]]  # the batches of steps 7 and 8
        assert len(rb["skipped_samples"]) == 2 * 8 and len(set(rb["skipped_samples"])) == 16
        assert first["steps"] == list(range(1, w.ROLL_STEPS + 1))  # each step once, through the end
        assert first["metrics_steps"] == first["steps"] or out is not first_rank[0]
        assert again["rollbacks"] == []
        assert again["losses"] == first["losses"]
        assert out["bitwise"]
    print(f"rollback suite: {max(o['cpu_s'] for o in first_rank):.1f} s CPU per rank")


def test_a_bad_loss_on_the_last_pp_stage_is_known_to_every_stage(tmp_path):
    """pp=2: the loss only the last stage computes goes NaN (grads finite) at one step and spikes at the
    next. Every stage skips the NaN step and reads the spike, so a rollback would be decided alike."""
    ranks = spawn(w.pp_loss_suite, 2, args=(str(tmp_path),), timeout_s=300)
    assert [r["last"] for r in ranks] == [False, True]
    first, last = ranks
    assert first["losses"][:w.PP_NAN - 1] == last["losses"][:w.PP_NAN - 1]
    assert first["losses"][w.PP_NAN:] == last["losses"][w.PP_NAN:]
    for r in ranks:
        nan = w.PP_NAN - 1
        assert r["losses"][nan] != r["losses"][nan]  # NaN on the first stage too
        assert r["skipped"] == [i == nan for i in range(w.PP_STEPS)]
        assert r["changed"] == [i != nan for i in range(w.PP_STEPS)]  # the skip left this stage's masters
        assert r["losses"][nan + 1] > 100 * r["losses"][nan - 1]
        watch = SpikeWatch(5.0, 2)  # both stages would roll back at the spike, and only there
        decisions = [watch.spike(loss, skipped) is not None for loss, skipped in zip(r["losses"], r["skipped"])]
        assert decisions == [i == nan + 1 for i in range(w.PP_STEPS)]
