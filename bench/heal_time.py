"""Time lost to one lost rank: replica recovery against a restart from the last checkpoint.

    .venv/bin/python bench/heal_time.py                     # 1000 steps, kill at step 131, a save every 20
    .venv/bin/python bench/heal_time.py --steps 2000 --kill-step 171 --save-every 50

Both runs train the same job (tiny, stage 3, 2 replicas x 2 shards = 4 ranks, global batch 8, the
same seed), and in both the rank at shard 1 of replica 1 SIGKILLs itself at the start of the same
step K (ZEROSHARD_KILL_FAULT, first attempt only):

- restart: one torchrun job of 4 ranks (--shard-size 2) with --resume auto, a checkpoint every E
  steps and --max-restarts 1: every rank restarts and reads the last checkpoint;
- replicas: one torchrun job per replica group (--replica-recovery --replicas 2, a torchft
  lighthouse): group 0 trains on while group 1 restarts and takes the live state from group 0.

The script polls the runs' metrics.jsonl and stamps each step record when it appears (a step taken
again after a restart or a heal is a new record). For each run it prints:
- steps redone (taken again after the kill), and steps the job trained with fewer replicas until the
  killed group was back;
- wall seconds lost: from step K-1's record to step K's, less the median step before the kill (the
  job's stall: a restart and its redone steps, or the live groups' re-forming of the quorum);
- time to rejoin: from step K-1's record of the killed group to its first step after the kill.
The healthy group must still be training when the killed one is back (--steps well past the kill):
a replacement that finds no live peer starts from step 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FAST = ["--model", "tiny", "--stage", "3", "--batch", "8", "--seq-len", "32", "--num-samples", "4096",
        "--no-profile", "--seed", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts", "1",
           "--master-port", str(free_port()), "-m", "zeroshard.cli.main", "train", *FAST, *args]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


class Stamps:
    """Wall time at which each step record appears in a metrics.jsonl (polled every 50 ms)."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen, self.events = path, set(), []  # events: (wall s, step, replicas)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.done.is_set():
            self.read()
            time.sleep(0.05)
        self.read()

    def read(self) -> None:
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        now = time.monotonic()
        for line in lines:
            if line.endswith("}") and line not in self.seen:  # a step taken again has other timings
                self.seen.add(line)
                record = json.loads(line)
                if "step" in record:
                    self.events.append((now, record["step"], record.get("replicas")))

    def first(self, step: int) -> float:
        return min(t for t, s, _ in self.events if s == step)

    def after(self, t0: float) -> tuple[float, int] | None:
        later = [(t, s) for t, s, _ in self.events if t > t0]
        return min(later) if later else None

    def median_step(self, upto: int) -> float:
        """The median time between consecutive steps up to ``upto`` (a group that joined late, healed
        from a peer, has no records of the steps before it joined; its first step warms up)."""
        have = sorted({s for _, s, _ in self.events if s <= upto})
        times = {s: self.first(s) for s in have}
        return statistics.median(times[s] - times[s - 1] for s in have[2:] if s - 1 in times)


def figures(name: str, job: Stamps, killed: Stamps, kill: int, redone: int, fewer: int | None) -> dict:
    t_kill = killed.first(kill - 1)
    back = killed.after(t_kill)
    median = job.median_step(kill - 1)
    lost = job.first(kill) - job.first(kill - 1) - median
    out = {"run": name, "steps_redone": redone, "steps_with_fewer_replicas": fewer, "median_step_s": median,
           "wall_s_lost": lost, "rejoin_s": None if back is None else back[0] - t_kill,
           "rejoined_at_step": None if back is None else back[1]}
    print(f"{name:>9}: steps redone {redone}, steps with fewer replicas {fewer}, wall lost {lost:.1f} s "
          f"(median step {median * 1000:.0f} ms), time to rejoin "
          + ("never" if back is None else f"{back[0] - t_kill:.1f} s (its first step then: {back[1]})"), flush=True)
    return out


def watched(procs: list[subprocess.Popen], stamps: list[Stamps], timeout_s: float) -> list[int]:
    for s in stamps:
        s.thread.start()
    codes = [p.wait(timeout=timeout_s) for p in procs]
    for s in stamps:
        s.done.set()
        s.thread.join()
    return codes


def restart_run(root: Path, args: argparse.Namespace) -> dict:
    run_dir = root / "restart"
    stamps = Stamps(run_dir / "metrics.jsonl")
    proc = torchrun(4, ["--shard-size", "2", "--steps", str(args.steps), "--resume", "auto", "--save-every",
                        str(args.save_every), "--ckpt-dir", str(root / "ckpt"), "--run-dir", str(run_dir)],
                    {"ZEROSHARD_KILL_FAULT": f"rank=3,step={args.kill_step},attempt=0"}, root / "restart.log")
    codes = watched([proc], [stamps], args.timeout)
    print(f"restart: exit code {codes[0]} (log {root / 'restart.log'})", flush=True)
    redone = (args.kill_step - 1) % args.save_every  # since the newest checkpoint before the kill
    return figures("restart", stamps, stamps, args.kill_step, redone, 0)


def replica_run(root: Path, args: argparse.Namespace) -> dict:
    # join_timeout longer than a step: a group waits for the other live one rather than forming a quorum alone.
    port = free_port()
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).with_name("torchft_lighthouse")), "--bind", f"[::]:{port}", "--min_replicas", "1",
         "--join_timeout_ms", "10000"], stdout=subprocess.DEVNULL, stderr=(root / "lighthouse.log").open("w"))
    common = ["--steps", str(args.steps), "--replica-recovery", "--replicas", "2"]
    stamps, procs = [], []
    for group in (0, 1):
        run_dir = root / f"replica{group}"
        env = {"REPLICA_GROUP_ID": str(group), "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
        if group == 1:
            env["ZEROSHARD_KILL_FAULT"] = f"rank=1,step={args.kill_step},attempt=0"
        stamps.append(Stamps(run_dir / "metrics.jsonl"))
        procs.append(torchrun(2, [*common, "--run-dir", str(run_dir)], env, root / f"replica{group}.log"))
        time.sleep(2)  # group 0 first, as a running job is when one of its groups dies (the other joins it)
    codes = watched(procs, stamps, args.timeout)
    lighthouse.terminate()
    lighthouse.wait()
    print(f"replicas: exit codes {codes} (logs {root}/replica*.log)", flush=True)
    back = stamps[1].after(stamps[1].first(args.kill_step - 1))
    # Until the killed group's first step after it came back from a live peer (a replacement that found
    # none started again from step 1, alone).
    until = back[1] if back is not None and back[1] >= args.kill_step else args.steps + 1
    fewer = len({s for _, s, n in stamps[0].events if n == 1 and args.kill_step <= s < until})
    return figures("replicas", stamps[0], stamps[1], args.kill_step, 0, fewer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--kill-step", type=int, default=131)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the figures there")
    args = parser.parse_args()
    if not 2 < args.kill_step < args.steps:
        parser.error(f"--kill-step {args.kill_step} must lie between 3 and --steps - 1")
    root = Path(tempfile.mkdtemp(prefix="zs-heal-time-"))
    print(f"run dirs under {root}", flush=True)
    rows = [restart_run(root, args), replica_run(root, args)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
