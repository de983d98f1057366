"""A long run: does a rank's resident memory stay flat, or do hooks, the ledger or buffers leak?

    .venv/bin/python bench/long_run.py [--steps 1000] [--stage 3] [--world 2] [--every 100]

Trains `tiny` through the same loop as `zeroshard train` (setup + train_step: hooks, the ledger,
flat buffers, the optimizer, metric all-reduces) and reads each rank's current RSS from
/proc/self/statm after every `--every` steps. Passes when RSS at the last step is within 2% of
RSS at step 100: allocations made while warming up (allocator pools, lazily created optimizer
state, the ledger's ring filling up) are done by step 100, so growth after it is a leak.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import tracemalloc

import zeroshard as zs
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.launch import spawn

TOLERANCE = 0.02
BASELINE_STEP = 100


def rss_bytes() -> int:
    """Resident set size now (not the peak: a leak must show up as growth, not as a high-water mark)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """A train Reporter that reads RSS after chosen steps, so the real `run_loop` is what runs."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.samples: dict[int, int] = {0: rss_bytes()}
        self.ledger_len: dict[int, int] = {0: 0}
        self.last_loss = float("nan")

    def start(self, info: dict) -> None:
        pass

    def step(self, rec) -> None:
        self.last_loss = rec.loss
        if rec.step % self.every == 0 or rec.step in (1, 10, BASELINE_STEP):
            self.samples[rec.step] = rss_bytes()
            self.ledger_len[rec.step] = len(zs.ledger().records)

    def finish(self, summary: dict) -> None:
        pass


def _rank(cfg: TrainConfig, every: int, ledger_capacity: int | None) -> dict:
    from zeroshard.trainer.train import run_loop, setup

    mesh = zs.init(timeout_s=cfg.hang_timeout_s)
    ledger = zs.ledger()
    if ledger_capacity is not None:
        ledger.capacity = ledger_capacity
        ledger.records = collections.deque(ledger.records, maxlen=ledger_capacity)
    run = setup(cfg, mesh)
    sampler = RssSampler(every)
    start = time.perf_counter()
    run_loop(run, sampler)  # every rank samples: the reporter is not rank-0 only here
    seconds = time.perf_counter() - start
    out = {"rank": mesh.rank, "rss": sampler.samples, "ledger_len": sampler.ledger_len, "seconds": seconds,
           "final_loss": sampler.last_loss,
           "ledger_records": len(ledger.records), "ledger_capacity": ledger.capacity,
           "collectives_per_step": ledger.next_seq / cfg.steps}
    zs.shutdown()
    return out


def ledger_record_bytes(n: int = 10_000) -> float:
    """Python heap bytes one completed ledger record holds, measured on a scratch ledger."""
    import torch

    from zeroshard.comm.ledger import Ledger

    ledger = Ledger(capacity=n)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(n):
        record = ledger.open(group="shard", op="reduce_scatter", numel=1 << 16, dtype=torch.float32, elem_size=4,
                             unit="blocks.1", phase="backward")
        ledger.complete(record)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--ledger-capacity", type=int, default=None,
                        help="shrink the collective ledger's ring (default: the library's) to tell its "
                             "bounded fill-up apart from a leak elsewhere")
    args = parser.parse_args(argv)
    if args.steps < BASELINE_STEP:
        parser.error(f"--steps must be at least {BASELINE_STEP}, the baseline step")
    cfg = TrainConfig(model="tiny", stage=args.stage, nproc=args.world, steps=args.steps, batch=16, seq_len=64,
                      warmup=10, lr=3e-3, min_lr=3e-4, log_every=args.steps)
    results = spawn(_rank, args.world, args=(cfg, args.every, args.ledger_capacity), timeout_s=3600)
    r0 = results[0]
    print(f"long run: tiny, stage {args.stage}, world {args.world}, {args.steps} steps "
          f"(batch {cfg.batch}x{cfg.seq_len}); ledger ring {r0['ledger_records']:,} of {r0['ledger_capacity']:,} "
          f"records ({r0['collectives_per_step']:.1f} collectives/step); current RSS per rank, MiB")
    steps = sorted(results[0]["rss"])
    print("step    " + "".join(f"{'rank ' + str(r['rank']):>12}" for r in results))
    for s in steps:
        print(f"{s:>6}  " + "".join(f"{r['rss'][s] / 2**20:>12.2f}" for r in results))
    ok = True
    for r in results:
        base, last = r["rss"][BASELINE_STEP], r["rss"][steps[-1]]
        change = (last - base) / base
        ok &= abs(change) < TOLERANCE
        print(f"rank {r['rank']}: RSS step {BASELINE_STEP} {base / 2**20:.2f} MiB -> step {steps[-1]} "
              f"{last / 2**20:.2f} MiB: {change * 100:+.3f}% (limit ±{TOLERANCE * 100:.0f}%); "
              f"{r['seconds']:.1f} s, {r['seconds'] / args.steps * 1e3:.1f} ms/step, final loss {r['final_loss']:.4f}")
    grown = r0["ledger_len"][steps[-1]] - r0["ledger_len"][BASELINE_STEP]
    per_record = ledger_record_bytes()
    print(f"the ledger's ring (bounded, {r0['ledger_capacity']:,} records) grew by {grown:,} records after step "
          f"{BASELINE_STEP}: about {grown * per_record / 2**20:.2f} MiB at {per_record:.0f} B per record")
    print("PASS: no growth after warm-up" if ok else "FAIL: RSS grew after warm-up")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
