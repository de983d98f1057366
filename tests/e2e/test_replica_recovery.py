"""A lost replica group rejoins without a restart of the other, in the suite's budget: 2 replica
groups x 1 shard (`zeroshard train --replica-recovery --replicas 2`, a torchft_lighthouse beside
them). Group 1 SIGKILLs itself at the start of step KILL; this test starts its replacement as
torchrun would (the next restart attempt). Checked: group 0 kept committing steps alone while group 1
was down, group 1 rejoined from group 0's live state (newer than anything it held, with no checkpoint
configured), a NaN from one group's backward made both groups skip that step, both groups end bitwise
equal, and the doctor and the end-of-run table show the changes.
scripts/replica_chaos.py runs the 2 x 2 version under torchrun; bench/heal_time.py times it against a
restart from a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli import FAST, read_metrics, run_main

pytest.importorskip("torchft")
if not Path(sys.executable).with_name("torchft_lighthouse").is_file():
    pytest.skip("torchft_lighthouse is not installed next to this Python", allow_module_level=True)

KILL, STEPS, NAN = 30, 90, 26
PACE_S, FIRST_PACE_S = 0.3, 1.0
# A group training alone waits PACE_S after each step, so that it does not finish before the other
# comes back (a replacement's start takes seconds); steps with both groups run at full speed. Until the
# groups first train together, the one that started first waits FIRST_PACE_S a step: the other's
# process start may lag by many seconds on a loaded machine, and both must be in before step KILL.
# Group 0's backward leaves a NaN in its grads at step NAN.
PACED = f"""
import os, sys, time
import zeroshard.trainer.replicas as replicas
from zeroshard.comm import get_ledger
from zeroshard.runtime.engine import get_engine
step, backward = replicas.replica_step, replicas.accumulate_gradients
together = []
def paced(run, group, index):
    out = step(run, group, index)
    if out["participants"] == 1:
        time.sleep({PACE_S} if together else {FIRST_PACE_S})
    else:
        together.append(index)
    return out
def nan_backward(model, x, y, **kw):
    out = backward(model, x, y, **kw)
    if os.environ["REPLICA_GROUP_ID"] == "0" and get_ledger().step == {NAN}:
        get_engine(model).trainable_groups[0].grad_shard.view(-1)[0] = float("nan")
    return out
replicas.replica_step, replicas.accumulate_gradients = paced, nan_backward
from zeroshard.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(index: int, lighthouse: str, run_dir: Path, attempt: int, log: Path) -> subprocess.Popen:
    """Rank 0 of a one-rank replica group, with the environment torchrun gives a rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()),
           "TORCHELASTIC_RESTART_COUNT": str(attempt), "REPLICA_GROUP_ID": str(index),
           "TORCHFT_LIGHTHOUSE": lighthouse, "ZEROSHARD_KILL_FAULT": f"rank=0,step={KILL},attempt=0" if index else ""}
    cmd = [sys.executable, "-c", PACED, "train", *FAST, "--stage", "3", "--steps", str(STEPS), "--replica-recovery",
           "--replicas", "2", "--no-profile", "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT)


def _trained_alone(run_dir: Path, *, since: int, steps: int) -> bool:
    """Whether the group of ``run_dir`` has recorded ``steps`` steps from ``since`` on with one group."""
    try:
        records = read_metrics(run_dir)
    except (OSError, ValueError):  # not written yet, or a line half written
        return False
    return sum(1 for r in records if r["step"] >= since and r.get("replicas") == 1) >= steps


def _run_groups(tmp_path: Path) -> tuple[list[int | None], int | None]:
    port = _port()
    lighthouse = subprocess.Popen([str(Path(sys.executable).with_name("torchft_lighthouse")), "--bind", f"[::]:{port}",
                                   "--min_replicas", "1", "--join_timeout_ms", "5000"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{port}"
    try:
        procs = [_group(i, address, tmp_path / f"r{i}", 0, tmp_path / f"r{i}.log") for i in (0, 1)]
        killed, replaced, deadline = None, None, time.monotonic() + 150
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if killed is None and procs[1].poll() is not None:
                killed = procs[1].returncode
            if killed is not None and replaced is None and _trained_alone(tmp_path / "r0", since=KILL, steps=2):
                # The replacement starts as torchrun's next attempt would, once group 0 has shown it goes
                # on alone: a replacement that starts within the lighthouse's join timeout is simply let
                # into the next quorum, and group 0 would never train alone.
                replaced = procs[1] = _group(1, address, tmp_path / "r1", 1, tmp_path / "r1.log")
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
        return [p.wait() for p in procs], killed
    finally:
        lighthouse.terminate()
        lighthouse.wait()


def test_a_killed_replica_group_rejoins_from_the_live_one(tmp_path: Path, capsys) -> None:
    codes, killed = _run_groups(tmp_path)
    logs = "\n".join((tmp_path / f"r{i}.log").read_text()[-3000:] for i in (0, 1))
    assert killed == -signal.SIGKILL and codes == [0, 0], (killed, codes, logs)
    r0, r1 = read_metrics(tmp_path / "r0"), read_metrics(tmp_path / "r1")
    joins = [[json.loads(line) for line in (tmp_path / f"r{i}" / "replicas.jsonl").read_text().splitlines()]
             for i in (0, 1)]
    # Both start at once; the one that forms the first quorum trains alone until the other joins it and
    # takes its live state (at step start0 or start1, well before the kill).
    start0, start1 = ([c["step"] for c in changes if c["event"] == "joined" and c["step"] < KILL] or [0]
                      for changes in joins)
    assert start0[0] < KILL - 5 and start1[0] < KILL - 5, (joins, logs)
    assert [r["step"] for r in r0] == list(range(start0[0] + 1, STEPS + 1)), logs  # every step once, no gap
    # Group 0's steps from the kill on, trained alone: its count kept rising while group 1 was down.
    alone = [r["step"] for r in r0 if r["step"] >= KILL and r["replicas"] == 1]
    assert len(alone) >= 2 and alone == list(range(KILL, KILL + len(alone))), (alone, logs)
    back = KILL + len(alone) - 1  # the last step group 0 took alone: group 1 took the live state there
    print(f"group 0 trained steps {KILL}-{back} alone; group 1 took the live state of step {back}")
    rejoined = [c["step"] for c in joins[1] if c["event"] == "joined" and c["step"] >= KILL]
    # Newer than any step the killed process had reached, and no checkpoint was configured: from a peer.
    assert rejoined == [back] and back > KILL - 1, (joins, logs)
    assert [p for i in (0, 1) for p in (tmp_path / f"r{i}").rglob("step-*")] == []  # no checkpoint anywhere
    # The replacement kept the records its group wrote before the kill, and went on after the rejoin.
    assert [r["step"] for r in r1] == list(range(start1[0] + 1, KILL)) + list(range(back + 1, STEPS + 1))
    # Group 0's NaN reached group 1 through the average over groups: both skipped that step, only it.
    assert [r["step"] for r in r0 + r1 if r.get("skipped")] == [NAN, NAN], logs
    s0, s1 = (json.loads((tmp_path / f"r{i}" / "summary.json").read_text()) for i in (0, 1))
    assert s0["params_digest"] == s1["params_digest"]  # the groups' final params are bitwise equal

    # What the doctor and the end-of-run table show of it (group 0 saw the other leave and join).
    events = [(c["step"], c["event"]) for c in s0["replica_changes"] if c["step"] >= KILL]
    assert events == [(KILL, "saw a group leave"), (back + 1, "saw a group join")], events
    doctor = run_main(["doctor", str(tmp_path / "r0")], capsys).stdout
    assert f"replica 0 saw a group leave at step {KILL}: 2 -> 1 groups training" in doctor, doctor
    assert f"replica 0 saw a group join at step {back + 1}" in doctor, doctor
    assert "replica change" in (tmp_path / "r0.log").read_text()
