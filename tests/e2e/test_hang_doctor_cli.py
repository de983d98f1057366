"""Injected faults end within the hang timeout, leave no process behind, and the doctor names them;
a healthy run's profile, trace and report. Real `zeroshard` subprocesses on two gloo ranks.

Each fault run is a few seconds of start-up plus the 3 s hang timeout; the file stays around a minute.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from test_cli import FAST, read_metrics, run_cli, run_main

from zeroshard.observing.doctor import analyse, load
from zeroshard.comm.ledger import read_dump
from zeroshard.observing.ring import read_ring

HANG_S = 3
STAGE3 = ["train", *FAST, "--nproc", "2", "--stage", "3", "--hang-timeout-s", str(HANG_S)]
TAG = "ZEROSHARD_TEST_TAG"


def leftovers(tag: str) -> list[str]:
    """Processes (any descendant of the run) that still carry the run's environment tag."""
    out = subprocess.run(["ps", "-eww", "e", "-o", "pid=,args="], capture_output=True, text=True).stdout
    return [line[:160] for line in out.splitlines() if f"{TAG}={tag}" in line]


def assert_nothing_left(tag: str) -> None:
    deadline = time.monotonic() + 10  # the multiprocessing resource tracker exits just after its parent
    while leftovers(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(tag), leftovers(tag)


def run_fault(tmp_path: Path, fault: str, extra: list[str] = ()) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    proc = run_cli([*STAGE3, "--steps", "3", "--run-dir", str(run_dir), *extra],
                   env={"ZEROSHARD_COMM_FAULT": fault, TAG: tag}, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("zeroshard train: error")]
    assert len(errors) == 1, proc.stderr
    assert "Timed out" not in proc.stderr, "gloo's own timeout fired before the watchdog"
    assert_nothing_left(tag)
    return proc, run_dir


def doctor(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    """`zeroshard doctor RUN_DIR`'s text and exit code, and the same report as data. In this process
    (an interpreter start less); test_desync_check_catches_a_silent_dtype_mismatch runs the doctor
    as a subprocess, as a user does."""
    proc = run_main(["doctor", str(run_dir)], capsys)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 1: it found a problem
    print(proc.stdout)
    return analyse(load(run_dir)), proc.stdout


def seq_of(records: list[dict], op: str, unit: str, phase: str, step: int) -> int:
    return next(r["seq"] for r in records if (r["op"], r["unit"], r["phase"], r["step"]) == (op, unit, phase, step))


def test_rank_skipping_a_unit_hangs_then_doctor_names_the_skipped_gather(tmp_path: Path, capsys):
    proc, run_dir = run_fault(tmp_path, "kind=skip-unit,rank=1,step=1,unit=blocks.2")
    assert "hang: collective #" in proc.stderr and f"zeroshard doctor {run_dir}" in proc.stderr
    header0, records0 = read_dump(run_dir / "ledger" / "rank-0.jsonl")
    header1, _ = read_dump(run_dir / "ledger" / "rank-1.jsonl")
    assert {header0["reason"], header1["reason"]} == {"hang", "peer"}  # both live ranks dumped
    expected = seq_of(records0, "all_gather", "blocks.2", "forward", 1)
    report, text = doctor(run_dir, capsys)
    assert report["verdict"] == "mismatch"
    assert report["at"] == {"seq": expected, "op": "all_gather", "unit": "blocks.2", "phase": "forward", "step": 1,
                            "ranks": [1]}
    assert f"collective #{expected}: rank 1 never entered all_gather of unit blocks.2 in phase forward" in text


def test_rank_raising_before_a_collective_is_named_with_the_collective_it_never_entered(tmp_path: Path, capsys):
    proc, run_dir = run_fault(tmp_path, "kind=raise,rank=1,step=1,unit=blocks.2")
    assert "rank 1 failed: RuntimeError: injected fault" in proc.stderr
    header0, records0 = read_dump(run_dir / "ledger" / "rank-0.jsonl")
    header1, records1 = read_dump(run_dir / "ledger" / "rank-1.jsonl")
    assert header1["reason"] == "error" and "Traceback" in header1["details"]
    assert header0["reason"] == "peer"  # the survivor dumped before the launcher stopped it
    expected = seq_of(records0, "all_gather", "blocks.2", "forward", 1)
    assert records1[-1]["seq"] == expected - 1
    report, text = doctor(run_dir, capsys)
    assert report["verdict"] == "never_entered"
    assert report["at"]["seq"] == expected and report["at"]["unit"] == "blocks.2"
    assert report["at"]["phase"] == "forward" and report["at"]["ranks"] == [1]
    assert [d["rank"] for d in report["died"]] == [1] and "injected fault" in report["died"][0]["message"]
    assert f"rank 1 never entered collective #{expected} (all_gather of unit blocks.2 in phase forward" in text


def test_mismatched_shape_is_named_even_though_gloo_aborts_a_rank(tmp_path: Path, capsys):
    proc, run_dir = run_fault(tmp_path, "kind=bad-shape,rank=1,step=1,unit=blocks.2")
    # gloo abort()s a rank that receives more bytes than it posted, which leaves no dump, only its
    # ring; the other rank fails on the broken connection and dumps. Which of the two reads the
    # surplus first depends on the ring's timing.
    dumped = [r for r in (0, 1) if (run_dir / "ledger" / f"rank-{r}.jsonl").exists()]
    assert len(dumped) == 1, dumped
    aborted = 1 - dumped[0]
    _, ring = read_ring(run_dir / "ledger" / f"rank-{aborted}.ring")
    _, records = read_dump(run_dir / "ledger" / f"rank-{dumped[0]}.jsonl")
    expected = seq_of(records, "all_reduce", "blocks.2", "forward", 1)
    assert seq_of(ring, "all_reduce", "blocks.2", "forward", 1) == expected
    report, text = doctor(run_dir, capsys)
    assert report["verdict"] == "mismatch" and report["mismatch"]["fields"] == ["numel"]
    assert report["at"]["seq"] == expected and report["at"]["unit"] == "blocks.2" and report["at"]["phase"] == "forward"
    assert f"collective #{expected} (all_reduce of unit blocks.2 in phase forward, step 1): numel: rank 0 8, rank 1 16" in text


def test_desync_check_catches_a_silent_dtype_mismatch(tmp_path: Path):
    proc, run_dir = run_fault(tmp_path, "kind=bad-dtype,rank=1,step=2,unit=blocks.2", ["--desync-check", "1"])
    assert "DesyncError: desync check at step 2: first divergence at collective #" in proc.stderr
    _, records0 = read_dump(run_dir / "ledger" / "rank-0.jsonl")
    expected = seq_of(records0, "all_reduce", "blocks.2", "forward", 2)
    assert f"collective #{expected} " in proc.stderr and "dtype: rank 0 float32, rank 1 int32" in proc.stderr
    proc = run_cli(["doctor", "--json", str(run_dir)])
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["at"]["seq"] == expected and report["mismatch"]["fields"] == ["dtype"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path_factory.mktemp("profiled") / "run"
    proc = run_cli([*STAGE3, "--steps", "6", "--trace", "--desync-check", "2", "--log", "tensorboard",
                    "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, run_dir


def test_profile_breakdown_and_overlap_in_metrics_and_summary(profiled):
    proc, run_dir = profiled
    metrics = read_metrics(run_dir)
    for index, m in enumerate(metrics):
        p = m["profile"]
        parts = sum(p[k] for k in ("data_s", "forward_s", "ag_wait_s", "backward_s", "rs_wait_s", "optimizer_s",
                                   "param_sync_s", "checkpoint_s", "other_s"))
        assert parts == pytest.approx(p["step_s"], rel=1e-6)
        assert 0.0 <= p["overlap"] <= 1.0 and p["comm_busy_s"] > 0
        # tiny at stage 3: forward gathers the root and 4 blocks, backward the 4 blocks again, except
        # (from step 2, once the order is known) the last block, kept from forward.
        assert p["ag_windows"] == (9 if index == 0 else 8) and 1 <= p["max_unsharded_units"] <= 3
        assert p["mfu"] > 0 and p["mfu"] == p["hfu"] and p["samples_per_s"] > 0
    for text in ("step time P50 / P99", "all-gather wait", "reduce wait", "overlap ratio", "MFU", "straggler"):
        assert text in proc.stdout, text
    for rank in (0, 1):
        assert len((run_dir / "profile" / f"rank-{rank}.jsonl").read_text().splitlines()) == 6
    report = analyse(load(run_dir))
    assert report["verdict"] == "ok"


def test_train_log_tensorboard_scalars_equal_metrics(profiled):
    from test_observe import tensorboard_scalars

    from zeroshard.observing.loggers import scalars

    _, run_dir = profiled
    board = tensorboard_scalars(run_dir)
    metrics = read_metrics(run_dir)
    assert {"train/loss", "train/grad_norm", "perf/mfu", "comm/bytes", "comm/exposed_s"} <= set(board)
    for m in metrics:
        for tag, value in scalars(m).items():
            assert board[tag][m["step"]] == pytest.approx(value, rel=2e-7, abs=1e-30), (tag, m["step"])


def test_trace_has_both_lanes_per_rank(profiled):
    _, run_dir = profiled
    for rank in (0, 1):
        events = json.loads((run_dir / "trace" / f"rank-{rank}.json").read_text())["traceEvents"]
        lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert {"compute", "collectives"} <= lanes
        cats = {e.get("cat") for e in events}
        assert {"step", "phase", "wait", "collective"} <= cats


def test_report_writes_four_pngs(profiled):
    _, run_dir = profiled
    proc = run_cli(["report", str(run_dir)])
    assert proc.returncode == 0, proc.stderr
    paths = [Path(line) for line in proc.stdout.split()]
    assert [p.name for p in paths] == ["loss.png", "step_time.png", "memory.png", "mesh.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
