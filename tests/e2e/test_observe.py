"""`zs.observe` around a user's own loop, as real subprocesses on two gloo ranks at stage 3.

- docs/observe.md's example loop (healthy, TensorBoard and W&B offline): metrics.jsonl, TensorBoard
  scalars equal to it, a W&B offline run, report PNGs, summary, doctor "ok";
- the logging bug (only rank 0 calls dist.all_reduce at step 3, tests/e2e/observe_loop.py): the job
  ends within the hang timeout and the doctor names rank 0's own collective with its stack, and
  rank 1's all-gather with unit, phase and step;
- `zeroshard train --log` errors: an unknown logger, a missing package.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli import FAST, read_metrics, run_main

from zeroshard.observing.doctor import analyse, load
from zeroshard.comm.ledger import read_dump
from zeroshard.observing.loggers import scalars

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 3
STEPS = 6


def run_script(args: list[str], env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    full = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full, timeout=timeout, cwd=ROOT)


def doc_example(tmp: Path) -> Path:
    text = (ROOT / "docs" / "observe.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if c.startswith("# observe: example\n"))
    path = tmp / "observe_example.py"
    path.write_text(code)
    return path


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("observe")
    run_dir = tmp / "run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp / "wandb"), "HOME": str(tmp)}
    (tmp / "wandb").mkdir()
    proc = run_script([str(doc_example(tmp)), str(run_dir), "tensorboard,wandb"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, run_dir


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_doc_example_writes_metrics_and_tensorboard_scalars_equal_to_them(healthy):
    proc, run_dir = healthy
    assert "final loss" in proc.stdout
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    board = tensorboard_scalars(run_dir)
    expected_tags = {"train/loss", "train/lr", "train/grad_norm", "perf/step_time_s", "perf/tokens_per_s", "perf/mfu",
                     "memory/peak_mb", "comm/bytes", "comm/exposed_s"}
    assert expected_tags <= set(board), sorted(board)
    for m in metrics:
        for tag, value in scalars(m).items():
            # TensorBoard keeps float32.
            assert board[tag][m["step"]] == pytest.approx(value, rel=2e-7, abs=1e-30), (tag, m["step"])
    assert all(m["profile"]["comm_bytes"] > 0 and m["profile"]["mfu"] > 0 for m in metrics)
    # obs.phase marked the parts: the breakdown has them, and they add up to the step.
    for m in metrics:
        p = m["profile"]
        assert p["forward_s"] > 0 and p["backward_s"] > 0 and p["optimizer_s"] > 0
        parts = sum(p[k] for k in ("data_s", "forward_s", "ag_wait_s", "backward_s", "rs_wait_s", "optimizer_s",
                                   "param_sync_s", "checkpoint_s", "other_s"))
        assert parts == pytest.approx(p["step_s"], rel=1e-6)


def test_wandb_offline_run_holds_the_same_names(healthy):
    _, run_dir = healthy
    runs = list((run_dir.parent / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    data = runs[0].read_bytes()
    for tag in ("train/loss", "perf/tokens_per_s", "perf/mfu", "memory/peak_mb", "comm/bytes", "comm/exposed_s"):
        assert tag.encode() in data, tag


def test_summary_report_pngs_and_doctor_ok(healthy, capsys):
    _, run_dir = healthy
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world"] == 2
    prof = summary["profile"]
    assert 0 < prof["step_p50_s"] <= prof["step_p99_s"] and prof["straggler_rank"] in (0, 1)
    assert prof["mfu"] > 0 and prof["overlap"] is not None
    proc = run_main(["report", str(run_dir)], capsys)  # in this process; test_hang_doctor_cli runs it as a subprocess
    assert proc.returncode == 0, proc.stderr
    paths = [Path(line) for line in proc.stdout.split()]
    assert [p.name for p in paths] == ["loss.png", "step_time.png", "memory.png", "mesh.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    report = analyse(load(run_dir))
    assert report["verdict"] == "ok", report["summary"]


def test_rank_zero_only_all_reduce_ends_within_the_hang_timeout_and_doctor_names_both_ranks(tmp_path: Path, capsys):
    run_dir = tmp_path / "run"
    script = ROOT / "tests" / "e2e" / "observe_loop.py"
    started = time.monotonic()
    proc = run_script([str(script), str(run_dir), "--bug-step", "3", "--hang-timeout-s", str(HANG_S)], timeout=180)
    wall = time.monotonic() - started
    assert proc.returncode != 0
    assert "Timed out" not in proc.stderr, "gloo's own timeout fired before the watchdog"
    # Both ranks are blocked; whichever watchdog fires first names its own collective.
    assert ("rank 1 failed: hang: collective #" in proc.stderr and "of unit <root> in phase forward" in proc.stderr) or (
        "rank 0 failed: hang: collective #" in proc.stderr and "the training loop's own torch.distributed" in proc.stderr)
    dumps = {r: read_dump(run_dir / "ledger" / f"rank-{r}.jsonl") for r in (0, 1)}
    assert sorted(h["reason"] for h, _ in dumps.values()) == ["hang", "peer"]
    fired, records = next(d for d in dumps.values() if d[0]["reason"] == "hang")
    stuck = next(r for r in records if r["state"] != "completed" and r["wait_start"] is not None)
    # From the moment that rank blocked to its dump: the hang timeout plus the watchdog's poll.
    assert fired["perf_counter"] - stuck["wait_start"] < HANG_S + 1.5
    print(f"wall {wall:.1f}s; blocked -> dump {fired['perf_counter'] - stuck['wait_start']:.2f}s")

    proc = run_main(["doctor", str(run_dir)], capsys)  # in this process: an interpreter start less
    assert proc.returncode == 1, proc.stdout + proc.stderr
    print(proc.stdout)
    text = proc.stdout
    seq = stuck["seq"]
    line = script.read_text().splitlines().index("    dist.all_reduce(total)") + 1
    where = f"tests/e2e/observe_loop.py:{line} in log_loss"
    assert f"collective #{seq}: rank 0 made its own torch.distributed all_reduce (step 3; rank 0 at {where})" in text
    assert f"rank 1: waiting in collective #{seq} all_gather of unit <root> in phase forward (step 4)" in text
    assert (f"rank 0: blocked outside zeroshard's collectives, in its own torch.distributed all_reduce "
            f"(collective #{seq}, step 3) made at {where}") in text
    assert "dist.all_reduce(total)" in text and "loss = model(x, y)" in text  # each rank's stack
    report = analyse(load(run_dir))
    assert report["verdict"] == "user_collective"
    assert report["at"] == {"seq": seq, "op": "all_reduce", "unit": "", "phase": "user", "step": 3, "ranks": [0]}
    blocked = report["ranks"][1]["blocked"]
    assert blocked["kind"] == "zeroshard" and blocked["entry"] == {
        "seq": seq, "op": "all_gather", "unit": "<root>", "phase": "forward", "step": 4}
    assert report["ranks"][0]["blocked"]["kind"] == "user"
    assert any("log_loss" in line for line in report["ranks"][0]["blocked"]["stack"])


def test_train_log_errors_are_one_line(tmp_path: Path, capsys):
    # An unknown logger is refused before launch: in this process. A missing package needs a
    # subprocess with that package shadowed.
    proc = run_main(["train", *FAST, "--steps", "1", "--log", "tensorbord", "--run-dir", str(tmp_path / "a")], capsys)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("zeroshard train: error: unknown logger 'tensorbord': choose from tensorboard, "
                                   "wandb (comma-separated)")
    shadow = tmp_path / "shadow" / "tensorboard"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed here')\n")
    proc = run_script(["-m", "zeroshard.cli.main", "train", *FAST, "--steps", "1", "--log", "tensorboard",
                       "--run-dir", str(tmp_path / "b")], env={"PYTHONPATH": f"{shadow.parent}:{ROOT}"})
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("zeroshard train: error: log='tensorboard' needs the tensorboard package, which "
                                   "is not installed: pip install 'zeroshard[log]'")
    assert not (tmp_path / "b").exists()
