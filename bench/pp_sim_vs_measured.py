"""Pipeline parallelism on this machine: the simulator's step time against a measured one, and the
measured bubble against (p - 1) / (m + p - 1).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/pp_sim_vs_measured.py [--model small --seq 128]

Worlds 2 and 4 on gloo, 1F1B, fp32, clipping off (the simulator has no clipping term): pp 2 alone
(one rank per core), pp 2 x shard 2 and pp 4. First the host is calibrated with one rank per core
exactly as ``zeroshard plan --calibrate`` does (zeroshard/sim/calibrate.py: links, one block's and
the root's forward and backward, contention), one microbatch of sequences per unit; the replay
shares the cores among the ranks computing at each moment (``simulate_pipeline(cores=)``), which is
what four ranks on two cores do, and why an idle rank's bubble lends its core to the others. Then
each configuration is built as ``zeroshard train --pp`` builds it
(``zeroshard.step.build``) and stepped by ``zeroshard.step.pipeline_step``, ``--warmup`` untimed
steps first, each timed step after a barrier; a step lasts as long as its slowest rank, and the
measured figure is the median step. The prediction is ``zeroshard.sim.pipeline.simulate_pipeline``
on the calibrated hardware.

The bubble: on every rank, the seconds inside torch's ``forward_one_chunk`` and
``backward_one_chunk`` (the stage's own compute, its sends and receives are posted and waited
outside them) over the seconds of the schedule's run (``Pipeline.run``) on its slowest rank (the
steps start together: each begins with an all-reduce); bubble = 1 - busy / span, averaged over
the pp ranks, against (p - 1) / (m + p - 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import zeroshard as zs
from zeroshard.config import TrainConfig
from zeroshard.launch import spawn


def measure_rank(cfgs: list[TrainConfig], steps: int, warmup: int) -> list[dict]:
    """Spawn target: per config, this rank's step times and its busy and schedule seconds per step."""
    import torch
    from torch.distributed.pipelining import stage as torch_stage

    from zeroshard import step
    from zeroshard.comm import collectives

    busy = [0.0]
    cls = torch_stage._PipelineStageBase  # noqa: SLF001 - timing torch's own stage calls, in this bench only
    originals = {name: getattr(cls, name) for name in ("forward_one_chunk", "backward_one_chunk")}

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - t0
        return wrapper

    for name, fn in originals.items():
        setattr(cls, name, timed(fn))
    out = []
    mesh = zs.init(pp=cfgs[0].pp)
    for cfg in cfgs:
        run = step.build(cfg, mesh)
        gen = torch.Generator().manual_seed(cfg.seed + mesh.rank)
        shape = (cfg.batch // mesh.dp_size, cfg.seq_len)
        x = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        y = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        span = [0.0]
        run_fn = run.pipeline.run

        def spanned(*args, _run=run_fn, **kwargs):
            t0 = time.perf_counter()
            try:
                return _run(*args, **kwargs)
            finally:
                span[0] += time.perf_counter() - t0

        run.pipeline.run = spanned
        for _ in range(warmup):
            step.pipeline_step(run, x, y)
        times, busies, spans = [], [], []
        for _ in range(steps):
            collectives.barrier(phase="bench")
            busy[0] = span[0] = 0.0
            t0 = time.perf_counter()
            step.pipeline_step(run, x, y)
            times.append(time.perf_counter() - t0)
            busies.append(busy[0])
            spans.append(span[0])
        out.append({"times": times, "busy": busies, "span": spans, "pp_rank": mesh.pp_rank})
        del run
    for name, fn in originals.items():
        setattr(cls, name, fn)
    zs.shutdown()
    return out


def config(args: argparse.Namespace, world: int, pp: int, m: int) -> TrainConfig:
    dp = world // pp
    return TrainConfig(model=args.model, nproc=world, pp=pp, pp_schedule="1f1b", microbatches=m,
                       batch=dp * m * args.micro_batch, seq_len=args.seq, clip=0.0, num_samples=max(256, dp * m),
                       steps=1000, warmup=0, stage=args.stage)


def predict(cfg: TrainConfig, hw, micro_batch: int, cores: int):
    from zeroshard.models import GPTConfig
    from zeroshard.sim.pipeline import simulate_pipeline
    from zeroshard.sim.step import Layout
    from zeroshard.sim.workload import Workload, gpt_shape

    shape = gpt_shape(GPTConfig.named(cfg.model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len), cfg.model)
    w = Workload(shape=shape, micro_batch=micro_batch, seq=cfg.seq_len, compute_bytes=4)
    layout = Layout(world=cfg.nproc // cfg.pp, stage=cfg.stage, param_bytes=4, reduce_bytes=4)
    # Unit times taken with one rank per core (world = cores); the replay shares the cores out.
    return simulate_pipeline(w, hw, layout, pp=cfg.pp, microbatches=cfg.microbatches, world=cores, cores=cores)


GROUPS = {(2, 2): (2, 4, 8), (4, 2): (2, 4), (4, 4): (4, 8)}
"""(world, pp) -> microbatch counts measured; one spawn each."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per microbatch on a rank")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="calibration repeats")
    args = ap.parse_args()
    from zeroshard.sim.calibrate import calibrate_world, hardware_from

    cores = os.cpu_count() or 1
    vocab = TrainConfig().vocab_size
    t0 = time.perf_counter()
    calib = calibrate_world(cores, args.model, vocab, args.micro_batch, args.seq, repeats=args.repeats)
    hw, _ = hardware_from({cores: [calib]}, args.model, vocab, args.micro_batch, args.seq)
    print(f"calibrated at world {cores} (one rank per core) in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
          flush=True)
    rows = []
    for (world, pp), ms in GROUPS.items():
        cfgs = [config(args, world, pp, m) for m in ms]
        per_rank = spawn(measure_rank, world, args=(cfgs, args.steps, args.warmup), timeout_s=1800)
        for i, cfg in enumerate(cfgs):
            slowest = [max(ts) for ts in zip(*(r[i]["times"] for r in per_rank))]
            # The schedule of one step lasts until its last rank is done: each rank's idle share of that.
            spans = [max(ss) for ss in zip(*(r[i]["span"] for r in per_rank))]
            bubbles = [1 - statistics.median(b / s for b, s in zip(r[i]["busy"], spans)) for r in per_rank]
            pred = predict(cfg, hw, args.micro_batch, cores)
            rows.append((world, pp, cfg.microbatches, pred, statistics.median(slowest), statistics.fmean(bubbles)))
    print(f"model {args.model}, seq {args.seq}, {args.micro_batch} sequence(s) per microbatch, stage {args.stage}, "
          f"1F1B, gloo, {cores} cores")
    print("| world | pipeline | microbatches | predicted step (ms) | measured step (ms) | error | "
          "simulated bubble | measured bubble | (p - 1) / (m + p - 1) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world, pp, m, pred, step_s, bubble in rows:
        where = f"pp {pp} x shard {world // pp}" if world > pp else f"pp {pp}"
        print(f"| {world} | {where} | {m} | {pred.step_s * 1e3:.1f} | {step_s * 1e3:.1f} | "
              f"{pred.step_s / step_s - 1:+.1%} | {pred.bubble:.1%} | {bubble:.1%} | {(pp - 1) / (m + pp - 1):.1%} |")


if __name__ == "__main__":
    main()
