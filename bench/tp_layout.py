"""Step time and peak memory per rank at world 4: (4 shard, 1 tp) against (2 shard, 2 tp).

    .venv/bin/python bench/tp_layout.py --model small --stage 3 --steps 3 --batch 8 --seq 128

Each layout runs in its own spawned gloo group (CPU here; the same code runs on NCCL). Prints the
slowest rank's median step time, each rank's peak RSS growth over the run, the bytes of the
model state each rank holds, and the ledger's bytes per step by (op, mesh dim, phase): the
measured cause of any difference. See docs/tensor_parallel.md.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch

import zeroshard as zs
from zeroshard.trainer import step
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.data import build_dataset, collate
from zeroshard.trainer.launch import spawn
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import get_engine
from zeroshard.parallel.tp import tensor_parallel
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_layout(shard: int, tp: int, model: str, stage: int, steps: int, batch: int, seq: int) -> dict:
    mesh = zs.init(mesh_shape=(shard, tp), names=("shard", "tp"))
    data = build_dataset(seq_len=seq, num_samples=max(64, batch * (steps + 2)), seed=0)
    torch.manual_seed(0)
    net = GPT(GPTConfig.named(model, seq_len=seq, vocab_size=data.vocab_size))
    if tp > 1:
        tensor_parallel(net)
    cfg = TrainConfig(stage=stage, nproc=mesh.world, batch=batch, seq_len=seq, lr=1e-4, min_lr=1e-4, warmup=0,
                      clip=1.0, seed=0)
    run = step.build(cfg, mesh, model=net, dataset=data)
    engine = get_engine(run.model)
    base_rss = _peak_rss_mib()
    ledger = zs.ledger()
    times: list[float] = []
    by_key: dict[str, float] = {}
    for index in range(steps + 1):  # the first step records the unit order and warms up
        x, y = collate(run.dataset, run.sampler.next_indices())
        start, seq_before = time.perf_counter(), ledger.next_seq
        step.step(run, x, y)
        if index == 0:
            continue
        times.append(step.slowest_rank(time.perf_counter() - start, mesh.device))
        for r in ledger.since(seq_before):
            if r.phase != step.METRICS_PHASE:
                key = f"{r.op}:{r.group}:{r.phase}"
                by_key[key] = by_key.get(key, 0) + r.bytes / steps
    state_bytes = sum(g.shard.numel() * g.shard.element_size() for g in engine.groups)
    state_bytes += sum(t.numel() * t.element_size() for s in run.opt.state.values() for t in s.values()
                       if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"step_s": statistics.median(times), "peak_rss_mib": _peak_rss_mib(), "rss_growth_mib":
            _peak_rss_mib() - base_rss, "state_mib": state_bytes / 2**20, "by_key": by_key,
            "peak_full_mib": engine.peak_full_bytes / 2**20}


def main() -> None:
    args = bench_parser(__doc__, model="small", stage=3, steps=3, batch=(8, "global batch (sequences)"),
                        seq=128).parse_args()
    for shard, tp in ((4, 1), (2, 2)):
        ranks = spawn(run_layout, 4, (shard, tp, args.model, args.stage, args.steps, args.batch, args.seq),
                      timeout_s=3600)
        first = ranks[0]
        print(f"({shard} shard, {tp} tp) {args.model} stage {args.stage}, global batch {args.batch} x {args.seq}: "
              f"step {first['step_s']:.2f} s (slowest rank, median of {args.steps})")
        for rank, r in enumerate(ranks):
            print(f"  rank {rank}: peak RSS {r['peak_rss_mib']:.0f} MiB (+{r['rss_growth_mib']:.0f} while "
                  f"training), model+optimizer state {r['state_mib']:.1f} MiB, peak gathered params "
                  f"{r['peak_full_mib']:.1f} MiB")
        for key, value in sorted(first["by_key"].items()):
            print(f"  {key:36s} {value / 2**20:9.2f} MiB/step")


if __name__ == "__main__":
    main()
