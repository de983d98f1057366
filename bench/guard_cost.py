"""What the non-finite guard costs per step (zeroshard/runtime/guard.py).

    .venv/bin/python bench/guard_cost.py --model small --nproc 2 --stage 3 --steps 8 --rounds 3

On `--nproc` gloo ranks, the same run with the guard on and off (and with clipping on and off),
interleaved round by round so drift hits all alike. Prints the median step time of each, and the
time spent inside the guard's decision itself (``should_skip``: reading the noted norm, its host
read and, without clipping or where the norm's reduction does not span the world, the norm and a
4-byte all-reduce). Also prints the collectives per step of each, from the ledger: with clipping
on at ZeRO over the whole world the guard adds none.
"""

from __future__ import annotations

import argparse
import statistics
import time

from zeroshard.comm import collectives
from zeroshard.comm.world import init
from zeroshard.runtime import guard
from zeroshard.trainer import step as step_mod
from zeroshard.trainer import train as train_mod
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.launch import spawn
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path

CASES = (("clip, guard on", 1.0, True), ("clip, guard off", 1.0, False),
         ("no clip, guard on", 0.0, True), ("no clip, guard off", 0.0, False))


def _timed_should_skip(spent: list[float]):
    original = guard.should_skip

    def timed(*args, **kwargs):  # the guard's own arguments, passed through as they come
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)
    return timed


def worker(args: argparse.Namespace) -> dict:
    mesh = init()
    spent: list[float] = []
    guard.should_skip = _timed_should_skip(spent)  # the optimizer reads it through the module
    out: dict = {name: {"step": [], "guard": [], "collectives": 0} for name, _, _ in CASES}
    for _ in range(args.rounds):
        for name, clip, on in CASES:
            cfg = TrainConfig(model=args.model, stage=args.stage, nproc=args.nproc, batch=args.batch,
                              seq_len=args.seq, steps=args.steps, clip=clip, skip_nonfinite=on)
            run = step_mod.build(cfg, mesh)
            for step in range(args.steps):
                spent.clear()
                seq0 = collectives.get_ledger().next_seq
                collectives.barrier()
                t0 = time.perf_counter()
                train_mod.train_step(run, step)
                dt = time.perf_counter() - t0
                if step >= 2:  # after warm-up
                    out[name]["step"].append(dt)
                    out[name]["guard"].append(sum(spent))
                    out[name]["collectives"] = collectives.get_ledger().next_seq - seq0 - 1  # less the barrier
    return out


def main() -> None:
    args = bench_parser(__doc__, model="small", nproc=2, stage=3, batch=4, seq=128, steps=8, rounds=3).parse_args()
    res = spawn(worker, args.nproc, args=(args,), timeout_s=3600)[0]
    print(f"{args.model}, stage {args.stage}, {args.nproc} gloo ranks, batch {args.batch} x {args.seq}")
    print(f"{'case':<20} {'median step ms':>15} {'guard ms':>9} {'collectives/step':>17}")
    for name, _, _ in CASES:
        r = res[name]
        print(f"{name:<20} {statistics.median(r['step']) * 1e3:15.1f} {statistics.median(r['guard']) * 1e3:9.3f} "
              f"{r['collectives']:17d}")


if __name__ == "__main__":
    main()
