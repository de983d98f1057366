"""A lost replica replaced without a restart of the others: 2 replica groups x 2 shards under torchrun.

    .venv/bin/python scripts/replica_chaos.py --steps 400

Starts a torchft lighthouse, then one torchrun job per replica group (`zeroshard train
--replica-recovery --replicas 2`, stage 3 over the group's 2 ranks, `--max-restarts 1`). Rank 1 of
replica 1 SIGKILLs itself at a random step (ZEROSHARD_KILL_FAULT); its torchrun restarts the group,
which takes the live state from replica 0 (no checkpoint is configured) and trains on. Prints what
each group saw and checks that replica 0 never stopped (its steps kept being committed with one
group while replica 1 was down), that replica 1 rejoined, and that the two groups' params end
bitwise equal (rank 0's master shards, by digest).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(replica: int, lighthouse: str, run_dir: Path, steps: int, kill_step: int | None) -> subprocess.Popen:
    env = {**os.environ, "REPLICA_GROUP_ID": str(replica), "TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1"}
    if kill_step is not None:
        env["ZEROSHARD_KILL_FAULT"] = f"rank=1,step={kill_step},attempt=0"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--master-port", str(free_port()), "-m", "zeroshard.cli.main", "train", "--model", "tiny", "--stage", "3",
           "--batch", "8", "--seq-len", "32", "--num-samples", "4096", "--steps", str(steps), "--replica-recovery",
           "--replicas", "2", "--no-profile", "--run-dir", str(run_dir)]
    log = (run_dir.parent / f"replica{replica}.log").open("w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def steps_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in (json.loads(line) for line in path.read_text().splitlines()) if "step" in r] if path.is_file() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    from torchft._torchft import LighthouseServer

    # Late enough that replica 1 has joined replica 0 (it starts seconds later and heals on joining),
    # early enough that replica 0 is still training when the restarted group comes back.
    kill_step = random.Random(args.seed).randint(int(args.steps * 0.35), int(args.steps * 0.5))
    # join_timeout longer than a step: a group waits for the other live ones to ask for the quorum too,
    # rather than forming one of its own (two quorums would train apart until one heals).
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000)
    root = Path(tempfile.mkdtemp(prefix="zs-replicas-"))
    t0 = time.monotonic()
    procs = [launch(0, lighthouse.address(), root / "r0", args.steps, None)]
    time.sleep(2)
    procs.append(launch(1, lighthouse.address(), root / "r1", args.steps, kill_step))
    codes = [p.wait(timeout=1800) for p in procs]
    wall = time.monotonic() - t0
    lighthouse.shutdown()
    r0, r1 = steps_of(root / "r0"), steps_of(root / "r1")
    s0 = json.loads((root / "r0" / "summary.json").read_text()) if (root / "r0" / "summary.json").is_file() else {}
    s1 = json.loads((root / "r1" / "summary.json").read_text()) if (root / "r1" / "summary.json").is_file() else {}
    alone = [r["step"] for r in r0 if r.get("replicas") == 1]
    print(f"run dirs under {root}; exit codes {codes}; {wall:.0f} s wall")
    print(f"replica 1 rank 1 killed at step {kill_step}")
    after_kill = [s for s in alone if s >= kill_step]
    print(f"replica 0: {len(r0)} steps committed, {len(after_kill)} of them alone after the kill "
          f"(steps {after_kill[:1]}..{after_kill[-1:]}); changes: {s0.get('replica_changes')}")
    print(f"replica 1: steps in its metrics {len(r1)}; changes: {s1.get('replica_changes')}")
    same = s0.get("params_digest") is not None and s0.get("params_digest") == s1.get("params_digest")
    print(f"final params (rank 0 master shards) bitwise equal across the groups: {same}")
    # Group 0 may itself have joined group 1's first steps (whichever group starts first trains alone until
    # the other joins); from then on its committed steps run without a gap to the end, through the kill.
    steps0 = [r["step"] for r in r0]
    after = [s for s in alone if s >= kill_step]  # alone from the kill until group 1 came back
    kept_going = bool(steps0) and steps0 == list(range(steps0[0], args.steps + 1)) and bool(after) \
        and after[0] <= kill_step + 1 and after == list(range(after[0], after[-1] + 1))
    print(f"replica 0 kept committing steps through the kill and while replica 1 was down: {kept_going}")
    ok = codes == [0, 0] and kept_going and same
    print("OK" if ok else "FAILED (see the replica logs in the run dirs' parent)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
