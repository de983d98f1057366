"""The runtime in a fake-GPU world (tests/fakecuda/fake_world.py): every stage, offload, clipping,
fp16 and accumulation, desync checks, the profiler's summary, state dicts, tp, pp and ep, at world
sizes 2-8 in one process, on a mesh whose device is an accelerator. It checks devices, ledger bytes,
host syncs and the order of stream and event calls, never numbers.

The cases run once, in one subprocess (tests/fakecuda/world_checks.py): the fake accelerator is
registered with torch for the life of a process, and no other test may run in one that has it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import world_checks as wc  # noqa: E402

EXPECTED_FAILURES, CANNOT_RUN = wc.EXPECTED_FAILURES, wc.CANNOT_RUN


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fakecuda") / "results.json"
    root = HERE.parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "world_checks.py"), str(out)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _ran(results: dict, name: str) -> dict:
    result = results[name]
    if "error" in result:
        pytest.fail(f"{name}: {result['error']}\n{result.get('trace', '')}")
    return result


def _marks(name: str) -> list:
    if name in EXPECTED_FAILURES:
        return [pytest.mark.xfail(strict=True, reason=EXPECTED_FAILURES[name])]
    if name in CANNOT_RUN:
        return [pytest.mark.xfail(strict=True, reason=f"cannot run in the fake world: {CANNOT_RUN[name]}")]
    return []


RUNNING = [n for n in wc.CASES if n not in EXPECTED_FAILURES and n not in CANNOT_RUN]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in wc.CASES])
def test_case_runs_with_every_tensor_on_the_device(results, name):
    result = _ran(results, name)
    assert result["mesh_device"].split(":")[0] == wc.fw.device().type
    assert result["loss_device"].split(":")[0] == wc.fw.device().type
    assert result["wrong_devices"] == []


def _expected_syncs(case: wc.Case) -> dict[str, int]:
    """The host syncs a step may make, by place: none per unit or group, whatever the world."""
    from zeroshard.models.gpt import GPTConfig

    cfg = wc.config_of(case)
    want = {}
    if cfg.clip > 0:
        want["step.grad_norm"] = 1  # the logged norm, read with the non-finite guard's flag
    elif cfg.skip_nonfinite:
        want["guard.nonfinite"] = 1  # the guard's flag: without clipping, from fp32 buffer norms
    if cfg.mp == "fp16":
        want["scaler.found_inf"] = 1  # one agreed flag, over every group
    if cfg.engine.offload.kind != "none":
        want["offload.grad_to_host"] = 1  # the newest copy's event covers every group's
        if cfg.clip > 0:
            want["clip.coef_to_host"] = 1  # host shards scaled by the clip coefficient, read once
    model = GPTConfig.named(cfg.model)
    if getattr(model, "n_expert", 0) and cfg.ep > 1:
        want["moe.splits"] = model.n_layer * cfg.accum  # one per MoE layer call (forward)
    return want


@pytest.mark.parametrize("name", RUNNING)
def test_host_syncs_per_step_are_named_and_none_per_unit(results, name):
    result = _ran(results, name)
    assert result["syncs"] == _expected_syncs(wc.CASES[name])


@pytest.mark.parametrize("name", RUNNING)
def test_no_copy_between_host_and_device_blocks_the_host(results, name):
    """A blocking copy is a host sync no ``.item()`` shows. Offload's copies (masters up at each
    gather, grads down after each reduction) are all non-blocking; nothing else crosses."""
    result = _ran(results, name)
    assert [c for c in result["copies"] if not c[2]] == []
    if not wc.CASES[name].cfg.get("offload"):
        assert result["copies"] == []


def test_stage3_hot_path_makes_no_host_sync(results):
    """Stage 3 without clipping or fp16: gathers, frees and reductions of every unit, and no sync but
    the non-finite guard's one flag per step."""
    result = _ran(results, "stage3-w8-noclip")
    assert result["units"] >= 5
    assert result["syncs"] == {"guard.nonfinite": 1}


@pytest.mark.parametrize("name", ["stage1-w4", "stage2-w2", "stage2-w4", "stage2-w8", "stage3-w3", "stage3-w4",
                                  "stage3-w8"])
def test_ledger_bytes_are_the_flat_buffers_once_per_collective(results, name):
    """Stages 1-2: one reduce-scatter of the padded flat grads and one all-gather of the updated
    params per step; stage 3: the same reduce-scatter and the units' all-gathers in forward and
    backward. (check_schedule also held the ledger to the step schedule, call by call.)"""
    result = _ran(results, name)
    flat_bytes = result["flat_numel"] * 4
    assert result["params"] * 4 <= flat_bytes < result["params"] * 4 * 1.25  # padding, not more
    assert result["bytes"]["reduce_scatter"] == flat_bytes
    if name.startswith("stage3"):
        # Every unit in forward and again in backward, but for the two kept from forward to backward
        # (the root, and the last block, whose backward starts right after its forward).
        assert result["ops"]["all_gather"] == 2 * result["units"] - 2
        assert flat_bytes < result["bytes"]["all_gather"] < 2 * flat_bytes
    else:
        assert result["bytes"]["all_gather"] == flat_bytes


def _calls(result: dict) -> list[tuple]:
    return [tuple(c) for c in result["calls"]]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n))
                                  for n in ("stage3-w8", "stage3-w3", "stage2-w4-bf16-accum", "tp2-w4", "ep2-w4")])
def test_side_streams_wait_for_the_compute_they_follow(results, name):
    """Every entry into a side stream comes after that stream waited for an event just recorded on
    the compute stream (the reduce stream at each launch, the all-gather stream at the step's start)
    and every all-gather runs on the all-gather stream."""
    result = _ran(results, name)
    calls = _calls(result)
    entered = [i for i, c in enumerate(calls) if c[0] == "enter"]
    assert entered, "no side stream was used"
    waited: dict[str, int] = {}
    recorded_on_compute = {c[1] for c in calls if c[0] == "record" and c[2] == "compute"}
    for i, call in enumerate(calls):
        if call[0] == "wait":
            assert call[1] in recorded_on_compute
            waited[call[2]] = i
        if call[0] == "enter":
            assert call[1] in waited and waited[call[1]] < i, f"{call[1]} entered before it waited"
    assert len({c[1] for c in calls if c[0] == "enter"}) == 2  # the all-gather and the reduce stream
    # Each all-gather and each flat reduce-scatter entered a side stream exactly once.
    enters = sum(1 for c in calls if c[0] == "enter")
    assert enters == result["ops"].get("all_gather", 0) + result["ops"].get("reduce_scatter", 0)


@pytest.mark.parametrize("name", ["offload-w4-noclip", "offload-w2-fp16-accum-noclip"])
def test_offload_copy_is_waited_on_before_any_host_read(results, name):
    """Defect 5 of issue 46: the device->host grad copies are non-blocking, so before the first grad
    shard reaches a reader (the scaler's unscale and inf check, clipping, the optimizer) the host
    waited for an event, and each wait is for the newest event recorded so far (the copies are queued
    in order on the compute stream, so it covers every one before it)."""
    calls = _calls(_ran(results, name))
    reads = [i for i, c in enumerate(calls) if c[0] == "read"]
    host_waits = [i for i, c in enumerate(calls) if c[0] == "host_wait"]
    assert reads and host_waits
    assert host_waits[0] < reads[0], f"a grad shard was read before any copy was waited on: {calls}"
    for i in host_waits:
        newest = max(c[1] for c in calls[:i] if c[0] == "record" and c[2] == "compute")
        assert calls[i][1] == newest


def test_every_case_is_in_the_matrix():
    """The matrix the suite claims: every stage at worlds 2, 4 and 8, tp, pp and ep, up to world 8."""
    worlds = {c.world for c in wc.CASES.values()}
    assert worlds == {2, 3, 4, 6, 8}
    for stage in range(4):
        assert {c.world for c in wc.CASES.values() if c.cfg.get("stage") == stage and len(c.cfg) == 1} >= {2, 4, 8}
    for dim in ("tp", "pp", "ep"):
        assert any(dim in c.cfg for c in wc.CASES.values())


NOT_IN_THE_WORLD = {
    "hf export and checkpoint save": "they write tensor values to files (safetensors, checksums), and fake tensors "
                                     "have none; their collective part (gathered_master) runs in the state-dict cases",
    "the topology gather at zs.init": "it sends every rank's host facts through all_gather_object, and the fake "
                                      "process group delivers no peer's object; the world is declared one host",
}


@pytest.mark.parametrize("part", sorted(NOT_IN_THE_WORLD))
def test_parts_that_cannot_run_in_the_fake_world_say_why(part):
    pytest.skip(f"{part}: {NOT_IN_THE_WORLD[part]}")
