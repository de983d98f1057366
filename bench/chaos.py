"""Chaos: SIGKILL random ranks of a torchrun job again and again, once in the middle of a save, and
check that the run still ends bitwise equal to an uninterrupted one.

    .venv/bin/python bench/chaos.py                        # 4 kills, synchronous saves
    .venv/bin/python bench/chaos.py --kills 6 --save-async --seed 3

The job is `torchrun --max-restarts K` of `zeroshard train --resume auto` (tiny, stage 3, world 2).
Attempt 0's rank 1 kills itself halfway through writing its file of one checkpoint
(ZEROSHARD_CKPT_FAULT with attempt=0); in each later attempt but the last, a rank drawn from
``--seed`` is SIGKILLed once a few steps past the checkpoint it resumed from. torchrun restarts the
group each time. The final checkpoint's params (exported) and rank files (masters and optimizer
state) are compared with an uninterrupted torchrun run of the same command. tests/e2e/test_chaos.py
runs it with two kills.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from zeroshard.checkpoint import export

FAST = ["--model", "tiny", "--batch", "8", "--seq-len", "32", "--num-samples", "256"]
TIMEOUT_S = 600


def torchrun() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return {**env, **extra}


def _parents() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def worker_pid(launcher: int, rank: int, attempt: int) -> int | None:
    """The torchrun worker with RANK=rank in restart attempt ``attempt`` under the launcher."""
    parents, found, frontier = _parents(), [], [launcher]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid]
        found += kids
        frontier += kids
    for pid in found:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and f"TORCHELASTIC_RESTART_COUNT={attempt}".encode() in env:
            return pid
    return None


def logged_steps(run_dir: Path) -> list[int]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [int(m.group(1)) for m in (re.search(r'"step": (\d+)', line) for line in lines) if m]


@dataclasses.dataclass
class Outcome:
    returncode: int
    output: str
    kills: list[tuple[int, int, int]]
    """(attempt, rank, last step logged when it was killed)."""
    resumed: list[int]
    """The step each restarted attempt resumed from."""
    seconds: float


def run(tmp: Path, name: str, *, steps: int, save_every: int, kills: int, save_async: bool, seed: int,
        timeout_s: float = TIMEOUT_S) -> Outcome:
    """One torchrun job; ``kills`` = 0 runs it uninterrupted. The first kill is the mid-save one."""
    ckpt, run_dir = tmp / f"{name}-ck", tmp / f"{name}-run"
    cmd = [*torchrun(), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(max(kills, 1)),
           "--monitor-interval", "0.2", "-m", "zeroshard.cli.main", "train", *FAST, "--warmup", "2", "--lr", "3e-3",
           "--stage", "3", "--steps", str(steps), "--save-every", str(save_every), "--ckpt-dir", str(ckpt),
           "--resume", "auto", "--keep-last", "2", "--run-dir", str(run_dir), "--log-every", "1000",
           *(["--save-async"] if save_async else [])]
    env = clean_env()
    if kills:  # attempt 0: rank 1 dies halfway through writing the second checkpoint
        env["ZEROSHARD_CKPT_FAULT"] = f"rank=1,step={2 * save_every},attempt=0"
    draw = random.Random(seed)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp,
                            start_new_session=True)
    done: list[tuple[int, int, int]] = []
    try:
        deadline = time.monotonic() + timeout_s
        for attempt in range(1, kills):
            # Wait for this attempt's workers, then until it is a few steps past where the last attempt
            # died (metrics.jsonl still ends there until the new attempt has resumed and replayed).
            while worker_pid(proc.pid, 0, attempt) is None and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            target = (logged_steps(run_dir) or [0])[-1] + draw.randint(1, save_every)
            while proc.poll() is None and time.monotonic() < deadline:
                logged = logged_steps(run_dir)
                if logged and logged[-1] >= target:
                    break
                time.sleep(0.01)
            rank = draw.randint(0, 1)
            victim = worker_pid(proc.pid, rank, attempt)
            if victim is None or proc.poll() is not None:
                break
            os.kill(victim, signal.SIGKILL)
            done.append((attempt, rank, logged_steps(run_dir)[-1]))
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session: torchrun and its workers
            proc.wait()
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)]
    return Outcome(proc.returncode, out, done, resumed, time.monotonic() - t0)


def final_state(ckpt: Path, tmp: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(every param from the export, every tensor of every rank file) of the newest checkpoint."""
    latest = ckpt / (ckpt / "latest").read_text().strip()
    out = tmp / f"{ckpt.name}.safetensors"
    export(latest, out)
    files = {}
    for f in sorted(latest.glob("rank-*.safetensors")):
        files.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return load_file(out), files


def bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=4, help="kills in all, the first one mid-save (default 4)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--save-async", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        tmp = Path(root)
        plain = run(tmp, "plain", steps=args.steps, save_every=args.save_every, kills=0, save_async=args.save_async,
                    seed=args.seed)
        chaos = run(tmp, "chaos", steps=args.steps, save_every=args.save_every, kills=args.kills,
                    save_async=args.save_async, seed=args.seed)
        for outcome in (plain, chaos):
            if outcome.returncode != 0:
                sys.exit(f"a run failed (exit {outcome.returncode}):\n{outcome.output[-3000:]}")
        params_a, files_a = final_state(tmp / "plain-ck", tmp)
        params_b, files_b = final_state(tmp / "chaos-ck", tmp)
    print(f"{args.steps} steps, a save every {args.save_every}{' (async)' if args.save_async else ''}, seed {args.seed}")
    print(f"kills: attempt 0 rank 1 mid-save of step {2 * args.save_every}; "
          + "; ".join(f"attempt {a} rank {r} after step {s}" for a, r, s in chaos.kills))
    print(f"resumed from steps {chaos.resumed}; uninterrupted {plain.seconds:.1f} s, with kills {chaos.seconds:.1f} s")
    print(f"final params bitwise: {bitwise(params_a, params_b)}; masters + optimizer state bitwise: "
          f"{bitwise(files_a, files_b)}")
    if not (bitwise(params_a, params_b) and bitwise(files_a, files_b)):
        sys.exit(1)


if __name__ == "__main__":
    main()
