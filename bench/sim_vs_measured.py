"""Predicted against measured step time on this machine: calibrate and measure in one run.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/sim_vs_measured.py \
        [--append docs/simulator.md --append bench/RESULTS.md]

One command prints the whole table. It runs ``--rounds`` rounds; each round, for each world size,
calibrates the simulator there exactly as ``zeroshard plan --calibrate`` does (zeroshard/tools/sim/
calibrate.py: collectives, units, contention, concurrency) and then measures the training step of
every configuration of that world: stages 0-3, and at world 4 stages 2 and 3 hybrid (2 replicas of
shard groups of 2). Rounds interleave calibration and measurement, and within a spawned group the
configurations take their steps in turn (step 1 of each, then step 2 of each, ...), so a load drift
on a shared host hits every row and the calibration alike instead of one row.

Each step is zeroshard/trainer/step.py's own (``build`` and ``step``, the training step itself), after a
barrier, ``--warmup`` untimed first; a step lasts as long as its slowest rank. The calibrated
hardware is the median of the rounds' figures (written to ``--hw-out``, every timing to
``--raw-out``, both under runs/ by default); the measured figure is the
median of every timed step of every round; "spread" is the range of the rounds' medians over that
median (how far the row moved between rounds) and "step range" that of all its steps. Clipping is
off in both (the simulator has no clipping term); fp32 throughout, as ``zeroshard train``'s default.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import zeroshard as zs
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.launch import spawn

TARGET = 0.15


def measure_rank(cfgs: list[TrainConfig], steps: int, warmup: int) -> list[list[float]]:
    """Spawn target: this rank's step times for each config; the configs take their steps in turn."""
    import torch

    from zeroshard.trainer import step
    from zeroshard.comm import collectives

    mesh = zs.init(shard_size=cfgs[0].shard_size)
    runs, batches = [], []
    for cfg in cfgs:
        gen = torch.Generator().manual_seed(cfg.seed + mesh.rank)
        shape = (cfg.batch // mesh.world, cfg.seq_len)
        batches.append((torch.randint(0, cfg.vocab_size, shape, generator=gen),
                        torch.randint(0, cfg.vocab_size, shape, generator=gen)))
        runs.append(step.build(cfg, mesh))
    for _ in range(warmup):  # in turn, as the timed steps run
        for run, (x, y) in zip(runs, batches):
            step.step(run, x, y)
    out: list[list[float]] = [[] for _ in cfgs]
    for _ in range(steps):
        for times, run, (x, y) in zip(out, runs, batches):
            collectives.barrier(phase="bench")
            start = time.perf_counter()
            step.step(run, x, y)
            times.append(time.perf_counter() - start)
    del runs
    gc.collect()
    zs.shutdown()
    return out


def configs(args: argparse.Namespace, world: int) -> list[list[TrainConfig]]:
    """The configs of one world size, one list per spawned group (one mesh shape each)."""
    base = TrainConfig(model=args.model, nproc=world, batch=args.micro_batch * world, seq_len=args.seq,
                       clip=0.0, num_samples=max(64, args.micro_batch * world), steps=1000, warmup=0)
    groups = [[base.replace(stage=s) for s in (0, 1, 2, 3)]]
    if world == 4:
        groups.append([base.replace(stage=s, shard_size=2) for s in (2, 3)])
    return groups


def label(cfg: TrainConfig) -> str:
    hybrid = f" hybrid {cfg.nproc // cfg.shard_size}x{cfg.shard_size}" if cfg.shard_size else ""
    return f"stage {cfg.stage}{hybrid}, world {cfg.nproc}"


def predict(cfg: TrainConfig, hw, micro_batch: int):
    from zeroshard.models import GPTConfig
    from zeroshard.tools.sim.step import Layout, simulate
    from zeroshard.tools.sim.workload import Workload, gpt_shape

    shape = gpt_shape(GPTConfig.named(cfg.model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len), cfg.model)
    w = Workload(shape=shape, micro_batch=micro_batch, seq=cfg.seq_len, compute_bytes=4)
    layout = Layout.of(world=cfg.nproc, stage=cfg.stage, shards=cfg.shard_size, prefetch=cfg.engine.prefetch,
                    bucket_mb=cfg.engine.bucket_mb, reshard_after_forward=cfg.engine.reshard_after_forward,
                    param_bytes=4, reduce_bytes=4)
    return simulate(w, hw, layout)


def run_rounds(args: argparse.Namespace, save) -> tuple[dict, dict]:
    """Every round's calibrations (per world) and step times (per config label, per round);
    ``save(calib, steps)`` after each round, so a run cut short keeps what it measured."""
    from zeroshard.tools.sim.calibrate import calibrate_world

    vocab = TrainConfig().vocab_size
    calib: dict[int, list[dict]] = {w: [] for w in args.worlds}
    steps: dict[str, list[list[float]]] = {}
    for r in range(args.rounds):
        for world in args.worlds:
            t0 = time.perf_counter()
            calib[world].append(calibrate_world(world, args.model, vocab, args.micro_batch, args.seq,
                                                repeats=args.repeats))
            t1 = time.perf_counter()
            for cfgs in configs(args, world):
                per_rank = spawn(measure_rank, world, args=(cfgs, args.steps, args.warmup), timeout_s=1800)
                for i, cfg in enumerate(cfgs):
                    slowest = [max(ts) for ts in zip(*(rank[i] for rank in per_rank))]
                    steps.setdefault(label(cfg), []).append(slowest)
            print(f"round {r + 1}/{args.rounds}, world {world}: calibrated in {t1 - t0:.0f} s, measured in "
                  f"{time.perf_counter() - t1:.0f} s", file=sys.stderr, flush=True)
        save(calib, steps)
    return calib, steps


def rows_for(args: argparse.Namespace, hw, steps: dict[str, list[list[float]]]) -> list[dict]:
    rows = []
    for world in args.worlds:
        for cfgs in configs(args, world):
            for cfg in cfgs:
                if label(cfg) not in steps:  # a run cut short, rebuilt with --from-raw
                    continue
                rounds = steps[label(cfg)]
                every = [t for r in rounds for t in r]
                measured = statistics.median(every)
                medians = [statistics.median(r) for r in rounds]
                pred = predict(cfg, hw, args.micro_batch)
                rows.append({"config": label(cfg), "predicted_s": pred.step_s, "measured_s": measured,
                             "error": pred.step_s / measured - 1,
                             "spread": (max(medians) - min(medians)) / measured,
                             "step_range": (max(every) - min(every)) / measured, "steps": len(every),
                             "compute_s": pred.compute_s, "optimizer_s": pred.optimizer_s,
                             "exposed_comm_s": pred.exposed_comm_s, "hidden_comm_s": pred.hidden_comm_s,
                             "contention_s": pred.breakdown.get("comm contention", 0.0)})
    return rows


def table(args: argparse.Namespace, rows: list[dict], hw, run: dict) -> str:
    when, load, minutes = run["when"], run["load"], run["minutes"]
    conc = "; ".join(f"world {k.world} groups of {k.group}: {k.two:.2f} / {k.three:.2f}" for k in hw.concurrency)
    lines = [f"`{args.model}`, micro-batch {args.micro_batch} x seq {args.seq} per rank, fp32, AdamW, clipping off, "
             f"gloo on this host ({os.cpu_count()} cores); {when}; load average (1, 5, 15 min) {load}; {args.rounds} rounds x "
             f"{args.steps} steps per config ({args.warmup} warm-up), {minutes:.1f} min in all.",
             f"Concurrency (two / three in flight, over serial): {conc}.", "",
             "| config | predicted s | measured s (median) | error | spread (rounds) | step range | compute "
             "| optimizer | exposed comm | hidden comm | contention |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['error']:+.1%} | "
                     f"{r['spread']:.0%} | {r['step_range']:.0%} | {r['compute_s']:.3f} | {r['optimizer_s']:.3f} | "
                     f"{r['exposed_comm_s']:.3f} | {r['hidden_comm_s']:.3f} | {r['contention_s']:.3f} |")
    within = sum(abs(r["error"]) <= TARGET for r in rows)
    worst = max(abs(r["error"]) for r in rows)
    lines += ["", f"{within} of {len(rows)} rows within {TARGET:.0%}; worst |error| {worst:.1%}."]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3, help="calibrate-then-measure rounds, interleaved")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per config per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per config per round (with one, "
                        "the first timed step of stages 1-3 ran up to 2x the rest in every round)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per calibration timing per round")
    parser.add_argument("--hw-out", default="runs/sim_vs_measured/local.toml", help="where the calibrated hardware TOML goes")
    parser.add_argument("--append", action="append", default=[], metavar="FILE.md",
                        help="also append the table, with the command and load, to this file (repeatable)")
    parser.add_argument("--raw-out", default="runs/sim_vs_measured/raw.json", metavar="FILE.json",
                        help="every calibration and step time measured, to rebuild the table with --from-raw")
    parser.add_argument("--from-raw", metavar="FILE.json", help="rebuild the table from a --raw-out file, "
                        "measuring nothing (e.g. after changing the replay)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or min(args.worlds) < 2:
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0, --worlds each >= 2")
    return args


def main(argv: list[str] | None = None) -> None:
    from zeroshard.tools.sim.calibrate import hardware_from
    from zeroshard.tools.sim.measured import to_toml

    args = parse(argv)
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    kept = [a for i, a in enumerate(argv) if a != "--append" and not (i and argv[i - 1] == "--append")]
    command = " ".join(["bench/sim_vs_measured.py", *kept])
    if args.from_raw:
        raw: dict = json.loads(Path(args.from_raw).read_text())
        calib = {int(w): runs for w, runs in raw.pop("calibration").items() if runs}
        steps = raw.pop("steps")
    else:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        raw = {}

        def save(calib: dict, steps: dict) -> None:
            end = " ".join(f"{x:.2f}" for x in os.getloadavg())
            raw.update({"command": command,
                        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                        "load": f"{load} at the start, {end} at the end",
                        "minutes": (time.perf_counter() - started) / 60})
            Path(args.raw_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.raw_out).write_text(json.dumps(raw | {"calibration": calib, "steps": steps}))

        calib, steps = run_rounds(args, save)
    hw, _ = hardware_from(calib, args.model, TrainConfig().vocab_size, args.micro_batch, args.seq,
                          name=Path(args.hw_out).stem)
    Path(args.hw_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.hw_out).write_text(to_toml(hw, f"written by bench/sim_vs_measured.py: median of {args.rounds} rounds"))
    rows = rows_for(args, hw, steps)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    text = table(args, rows, hw, raw)
    print("\n" + text)
    heading = raw.get("command", command) + (f" (table rebuilt by {command})" if args.from_raw else "")
    for path in args.append:
        with open(path, "a") as f:
            f.write(f"\n### `{heading}`\n\n{text}\n")


if __name__ == "__main__":
    main()
