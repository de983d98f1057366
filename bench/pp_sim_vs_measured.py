"""Pipeline parallelism on this machine: the simulator's step time against a measured one, and the
measured bubble against the equal-stage one ((p - 1) / (v·m + p - 1) for the 1F1B family).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/pp_sim_vs_measured.py [--model small --seq 128]
        [--schedule 1f1b | interleaved-1f1b | interleaved-zero-bubble | gpipe | looped-bfs]

Worlds 2 and 4 on gloo, fp32, clipping off (the simulator has no clipping term): pp 2 alone
(one rank per core), pp 2 x shard 2 and, for one stage per rank, pp 4. Before each group the
host is calibrated with one rank per core exactly as ``zeroshard plan --calibrate`` does
(zeroshard/tools/sim/calibrate.py: links, one block's and the root's forward and backward,
contention), one microbatch of sequences per unit; the replay
shares the cores among the ranks computing at each moment (``simulate_pipeline(cores=)``), which is
what four ranks on two cores do, and why an idle rank's bubble lends its core to the others. Then
each configuration is built as ``zeroshard train --pp`` builds it
(``zeroshard.trainer.step.build``) and stepped by ``zeroshard.trainer.step.pipeline_step``, ``--warmup`` untimed
steps first, each timed step after a barrier; a step lasts as long as its slowest rank, and the
measured figure is the median step. The prediction is ``zeroshard.tools.sim.pipeline.simulate_pipeline``
on the calibrated hardware.

The bubble is read as the step profiler reads it (zeroshard/observing/profile/pipeline.py): on every rank,
the seconds between each stage's ``compute_begin`` and ``compute_end`` events (one microbatch's
forward, backward or weight half; sends and receives are posted and waited outside them) over the
loop's "pipeline" span (torch's schedule) on its slowest rank (the steps start together: each
begins with an all-reduce); bubble = 1 - busy / span, averaged over the pp ranks, against the
planner's equal-stage figure (``PipelineShape.bubble``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import zeroshard as zs
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.launch import spawn
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path


def measure_rank(cfgs: list[TrainConfig], steps: int, warmup: int) -> list[dict]:
    """Spawn target: per config, this rank's step times and its busy and schedule seconds per step,
    read as the step profiler reads them (zeroshard/observing/profile/pipeline.py): the loop's "pipeline" span
    and each stage's compute events."""
    import torch

    from zeroshard.trainer import step
    from zeroshard.comm import collectives
    from zeroshard.observing.profile import timeline as tl
    from zeroshard.observing.profile.pipeline import PipelineClock

    out = []
    mesh = zs.init(pp=cfgs[0].pp)
    timeline = tl.Timeline()
    tl.activate(timeline)
    for cfg in cfgs:
        run = step.build(cfg, mesh)
        clock = PipelineClock(run.pipeline)
        gen = torch.Generator().manual_seed(cfg.seed + mesh.rank)
        shape = (cfg.batch // mesh.dp_size, cfg.seq_len)
        x = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        y = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        for _ in range(warmup):
            step.pipeline_step(run, x, y)
        clock.take(timeline.take()[0])
        times, busies, spans = [], [], []
        for _ in range(steps):
            collectives.barrier(phase="bench")
            timeline.take()
            t0 = time.perf_counter()
            step.pipeline_step(run, x, y)
            times.append(time.perf_counter() - t0)
            figures = clock.take(timeline.take()[0])
            busies.append(figures["compute_s"])
            spans.append(figures["schedule_s"])
        clock.close()
        out.append({"times": times, "busy": busies, "span": spans, "pp_rank": mesh.pp_rank,
                    "theory": clock.theory})
        del run
    tl.activate(None)
    zs.shutdown()
    return out


def config(args: argparse.Namespace, world: int, pp: int, m: int) -> TrainConfig:
    dp = world // pp
    return TrainConfig(model=args.model, nproc=world, pp=pp, pp_schedule=args.schedule, microbatches=m,
                       batch=dp * m * args.micro_batch, seq_len=args.seq, clip=0.0, num_samples=max(256, dp * m),
                       steps=1000, warmup=0, stage=args.stage)


def predict(cfg: TrainConfig, hw, micro_batch: int, cores: int):
    from zeroshard.models import GPTConfig
    from zeroshard.parallel.pipeline.schedules import schedule_spec, stages_per_rank
    from zeroshard.tools.sim.pipeline import simulate_pipeline
    from zeroshard.tools.sim.step import Layout
    from zeroshard.tools.sim.workload import Workload, gpt_shape

    shape = gpt_shape(GPTConfig.named(cfg.model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len), cfg.model)
    w = Workload(shape=shape, micro_batch=micro_batch, seq=cfg.seq_len, compute_bytes=4)
    layout = Layout.of(world=cfg.nproc // cfg.pp, stage=cfg.stage, param_bytes=4, reduce_bytes=4)
    # Unit times taken with one rank per core (world = cores); the replay shares the cores out.
    per_rank = stages_per_rank(schedule_spec(cfg.pp_schedule), cfg.pp_stages_per_rank)
    return simulate_pipeline(w, hw, layout, pp=cfg.pp, schedule=cfg.pp_schedule, microbatches=cfg.microbatches,
                             stages_per_rank=per_rank, world=cores, cores=cores)


GROUPS = {(2, 2): (2, 4, 8), (4, 2): (2, 4), (4, 4): (4, 8)}
"""(world, pp) -> microbatch counts measured; one spawn each."""
MULTI_GROUPS = {(2, 2): (2, 4, 8), (4, 2): (2, 4)}
"""The same for schedules of two stages per rank (the 12 blocks of small do not split into 8 stages)."""


def main() -> None:
    args = bench_parser(__doc__, model="small", seq=128, micro_batch=(1, "sequences per microbatch on a rank"), stage=2,
                        schedule=("1f1b", "pp_schedule: 1f1b, interleaved-1f1b, interleaved-zero-bubble, ..."),
                        steps=5, warmup=2, repeats=(5, "calibration repeats")).parse_args()
    from zeroshard.tools.sim.calibrate import calibrate_world, hardware_from

    cores = os.cpu_count() or 1
    vocab = TrainConfig().vocab_size
    rows = []
    from zeroshard.parallel.pipeline.schedules import schedule_spec

    for (world, pp), ms in (MULTI_GROUPS if schedule_spec(args.schedule).multi else GROUPS).items():
        # Calibrated again right before each group is measured: a shared host's speed drifts by more
        # than the model's error over the minutes the whole bench takes.
        t0 = time.perf_counter()
        calib = calibrate_world(cores, args.model, vocab, args.micro_batch, args.seq, repeats=args.repeats)
        hw, _ = hardware_from({cores: [calib]}, args.model, vocab, args.micro_batch, args.seq)
        print(f"calibrated at world {cores} (one rank per core) in {time.perf_counter() - t0:.0f} s, before "
              f"world {world} pp {pp}", file=sys.stderr, flush=True)
        cfgs = [config(args, world, pp, m) for m in ms]
        per_rank = spawn(measure_rank, world, args=(cfgs, args.steps, args.warmup), timeout_s=1800)
        for i, cfg in enumerate(cfgs):
            slowest = [max(ts) for ts in zip(*(r[i]["times"] for r in per_rank))]
            # The schedule of one step lasts until its last rank is done: each rank's idle share of that.
            spans = [max(ss) for ss in zip(*(r[i]["span"] for r in per_rank))]
            bubbles = [1 - statistics.median(b / s for b, s in zip(r[i]["busy"], spans)) for r in per_rank]
            pred = predict(cfg, hw, args.micro_batch, cores)
            rows.append((world, pp, cfg.microbatches, pred, statistics.median(slowest), statistics.fmean(bubbles),
                         per_rank[0][i]["theory"]))
    print(f"model {args.model}, seq {args.seq}, {args.micro_batch} sequence(s) per microbatch, stage {args.stage}, "
          f"{args.schedule}, gloo, {cores} cores")
    print("| world | pipeline | microbatches | predicted step (ms) | measured step (ms) | error | "
          "simulated bubble | measured bubble | equal-stage bubble |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world, pp, m, pred, step_s, bubble, theory in rows:
        where = f"pp {pp} x shard {world // pp}" if world > pp else f"pp {pp}"
        print(f"| {world} | {where} | {m} | {pred.step_s * 1e3:.1f} | {step_s * 1e3:.1f} | "
              f"{pred.step_s / step_s - 1:+.1%} | {pred.bubble:.1%} | {bubble:.1%} | {theory:.1%} |")


if __name__ == "__main__":
    main()
