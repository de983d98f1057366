"""The engine's events at world 2, stage 3, on a tiny model: which fire, in what order, with what bytes.

Bytes are derived here from the model's shapes and the layout rule (each param padded to 64
elements, the buffer to a multiple of 64 × world), not read back from the runtime.
"""

from __future__ import annotations

import pytest

import events_workloads as ew
from zeroshard.trainer.launch import spawn

WORLD = 2
ALIGN = 64  # elements: zeroshard/runtime/layout.py's alignment, restated as the rule under test


def _padded(*numels: int) -> int:
    spans = sum(-(-n // ALIGN) * ALIGN for n in numels)
    return -(-spans // (ALIGN * WORLD)) * (ALIGN * WORLD)


BLOCK = (16 * 16, 16)  # Linear(16, 16): weight, bias
ROOT = (16 * 8,)  # the head
UNITS = {"blocks.0": BLOCK, "blocks.1": BLOCK, "<root>": ROOT}


def full_bytes(unit: str, itemsize: int = 4) -> int:
    return _padded(*UNITS[unit]) * itemsize


def grad_bytes(unit: str, itemsize: int) -> int:
    return sum(UNITS[unit]) * itemsize


def shard_bytes(unit: str) -> int:
    return _padded(*UNITS[unit]) // WORLD * 4


@pytest.fixture(scope="module")
def ran():
    return spawn(ew.events_suite, WORLD, timeout_s=300)


def _of(events, kind):
    return [e for e in events if e[0] == kind]


@pytest.mark.parametrize("case", ["fp32", "bf16", "default"])
def test_events_follow_the_documented_order(ran, case):
    for rank, result in enumerate(ran):
        order = result[case]["reduce_order"]
        assert order == ["blocks.1", "blocks.0", "<root>"]
        assert len(result[case]["steps"]) == ew.STEPS
        for events in result[case]["steps"]:
            print(f"rank {rank} {case}: {[e[:2] for e in events]}")
            # Reductions launch, and are done, in the fixed order; each is done after its launch.
            assert [e[1] for e in _of(events, "reduce_launched")] == order
            assert [e[1] for e in _of(events, "reduce_done")] == order
            for unit in order:
                assert events.index(("reduce_launched", unit, "backward", _launched(case, unit))) < \
                    events.index(("reduce_done", unit, "backward", shard_bytes(unit)))
            # A unit's gathers and frees alternate, starting with a gather; every block is gathered
            # for forward and freed before the step ends.
            for unit in UNITS:
                moves = [e[0] for e in events if e[0] in ("gather", "free") and e[1] == unit]
                assert moves and moves == ["gather", "free"] * (len(moves) // 2), (unit, moves)
            # grads_collected only where a flat buffer is filled (bf16 reduction), right before its launch.
            collected = _of(events, "grads_collected")
            if case == "bf16":
                assert [e[1] for e in collected] == order
                for e in collected:
                    nxt = events[events.index(e) + 1]
                    assert nxt[:2] == ("reduce_launched", e[1]) and e[3] == full_bytes(e[1], 2)
            else:
                assert collected == []  # gloo reduces fp32 grads where they lie
            # One step, last: after every reduce_done (both ranks' shards hold params of every unit).
            assert _of(events, "step") == [events[-1]] == [("step", "", "step", sum(map(shard_bytes, UNITS)))]


def _launched(case: str, unit: str) -> int:
    return grad_bytes(unit, 2 if case == "bf16" else 4)


@pytest.mark.parametrize("case", ["fp32", "bf16", "default"])
def test_gather_and_free_bytes_are_the_units_full_params(ran, case):
    for result in ran:
        for events in result[case]["steps"]:
            for kind, unit, phase, nbytes in events:
                if kind in ("gather", "free"):
                    assert nbytes == full_bytes(unit), (kind, unit, nbytes)
                    assert phase in ("forward", "backward")
            forward = [e[1] for e in _of(events, "gather") if e[2] == "forward"]
            assert forward == ["<root>", "blocks.0", "blocks.1"]


def test_without_opportunistic_reaping_every_rank_and_step_sees_one_sequence(ran):
    steady = [r["fp32"]["steps"][-1] for r in ran]
    assert steady[0] == steady[1]
    # The default finishes reductions as gloo completes them: the same events, maybe sooner.
    for r in ran:
        for fixed, default in zip(r["fp32"]["steps"], r["default"]["steps"]):
            assert sorted(fixed) == sorted(default)


def test_subscriptions_end_and_filter_by_kind(ran):
    for r in ran:
        for case in ("fp32", "bf16", "default"):
            assert r[case]["after_unsubscribe"] == 0
            assert r[case]["only_steps"] == ["step"]
            assert r[case]["options"].reap_when_done is (case == "default")
