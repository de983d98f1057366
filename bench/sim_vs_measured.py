"""Predicted against measured step time on this machine, after calibrating the simulator here.

    zeroshard plan --calibrate --model small --seq 128 --micro-batch 1 --sweep 2,4 --hw-out local.toml
    .venv/bin/python bench/sim_vs_measured.py --hw local.toml --model small --seq 128 --micro-batch 1

Without ``--hw`` (or with a file that does not exist yet) it calibrates first, exactly as
``zeroshard plan --calibrate`` does (zeroshard/sim/calibrate.py), and writes the file. Then for
each world size it spawns one gloo group per mesh shape and runs, one after another, stages 0-3
(and at world 4 stages 2 and 3 hybrid: 2 replicas of shard groups of 2), each built and stepped by
zeroshard/step.py (``build`` and ``step``, the training step itself): ``--warmup`` untimed steps,
then ``--steps`` timed ones, each after a barrier; a step lasts as long as its slowest rank and the
figure is the median. The prediction is ``zeroshard.sim.simulate`` of the same layout on the
calibrated hardware. Clipping is off in both (the simulator has no clipping term); fp32 throughout,
as ``zeroshard train``'s default.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import zeroshard as zs
from zeroshard.config import TrainConfig
from zeroshard.launch import spawn


def measure_rank(cfgs: list[TrainConfig], steps: int, warmup: int) -> list[list[float]]:
    """Spawn target: this rank's step times for each config, in order."""
    import torch

    from zeroshard import step
    from zeroshard.comm import collectives

    mesh = zs.init(shard_size=cfgs[0].shard_size)
    out = []
    for cfg in cfgs:
        gen = torch.Generator().manual_seed(cfg.seed + mesh.rank)
        shape = (cfg.batch // mesh.world, cfg.seq_len)
        x = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        y = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        run = step.build(cfg, mesh)
        for _ in range(warmup):
            step.step(run, x, y)
        times = []
        for _ in range(steps):
            collectives.barrier(phase="bench")
            start = time.perf_counter()
            step.step(run, x, y)
            times.append(time.perf_counter() - start)
        out.append(times)
        del run
        gc.collect()
    zs.shutdown()
    return out


def configs(args: argparse.Namespace) -> list[tuple[str, list[TrainConfig]]]:
    """(label, configs) per spawned group: one group per world size and mesh shape."""
    groups = []
    for world in args.worlds:
        base = TrainConfig(model=args.model, nproc=world, batch=args.micro_batch * world, seq_len=args.seq,
                           clip=0.0, num_samples=max(64, args.micro_batch * world), steps=1000, warmup=0)
        groups.append((f"world {world}", [dataclasses.replace(base, stage=s) for s in (0, 1, 2, 3)]))
        if world == 4:
            groups.append(("hybrid", [dataclasses.replace(base, stage=s, shard_size=2) for s in (2, 3)]))
    return groups


def predict(cfg: TrainConfig, hw, micro_batch: int):
    from zeroshard.models import GPTConfig
    from zeroshard.sim.step import Layout, simulate
    from zeroshard.sim.workload import Workload, gpt_shape

    shape = gpt_shape(GPTConfig.named(cfg.model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len), cfg.model)
    w = Workload(shape=shape, micro_batch=micro_batch, seq=cfg.seq_len, compute_bytes=4)
    layout = Layout(world=cfg.nproc, stage=cfg.stage, shards=cfg.shard_size, prefetch=cfg.prefetch,
                    bucket_mb=cfg.bucket_mb, reshard_after_forward=cfg.reshard_after_forward,
                    param_bytes=4, reduce_bytes=4)
    return simulate(w, hw, layout)


def hardware(args: argparse.Namespace):
    from zeroshard.sim.calibrate import calibrate_hardware
    from zeroshard.sim.hardware import load_hardware
    from zeroshard.sim.measured import to_toml

    path = Path(args.hw)
    if path.is_file():
        return load_hardware(str(path))
    hw, _ = calibrate_hardware(tuple(args.worlds), args.model, TrainConfig().vocab_size, args.micro_batch,
                               args.seq, name=path.stem)
    path.write_text(to_toml(hw, "written by bench/sim_vs_measured.py"))
    return hw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hw", default="local.toml", help="calibrated hardware TOML (written if missing)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    hw = hardware(args)
    rows = []
    for label, cfgs in configs(args):
        per_rank = spawn(measure_rank, cfgs[0].nproc, args=(cfgs, args.steps, args.warmup), timeout_s=1800)
        for i, cfg in enumerate(cfgs):
            steps = [max(ts) for ts in zip(*(r[i] for r in per_rank))]
            measured = statistics.median(steps)
            pred = predict(cfg, hw, args.micro_batch)
            name = f"stage {cfg.stage}" + (f" hybrid {cfg.nproc // cfg.shard_size}x{cfg.shard_size}"
                                           if cfg.shard_size else "")
            rows.append({"config": f"{name}, world {cfg.nproc}", "predicted_s": pred.step_s, "measured_s": measured,
                         "error": pred.step_s / measured - 1, "spread": (max(steps) - min(steps)) / measured,
                         "compute_s": pred.compute_s, "optimizer_s": pred.optimizer_s,
                         "exposed_comm_s": pred.exposed_comm_s,
                         "contention_s": pred.breakdown.get("comm contention", 0.0)})
        print(f"{label}: measured", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"\n{args.model}, micro-batch {args.micro_batch} x seq {args.seq}, fp32, hardware {args.hw}\n")
    print("| config | predicted s | measured s | error | spread | pred. compute | optimizer | exposed comm "
          "| contention |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['config']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['error']:+.1%} | "
              f"{r['spread']:.0%} | {r['compute_s']:.3f} | {r['optimizer_s']:.3f} | {r['exposed_comm_s']:.3f} | "
              f"{r['contention_s']:.3f} |")
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nworst |error| {worst:.1%} (target 15%)")


if __name__ == "__main__":
    main()
