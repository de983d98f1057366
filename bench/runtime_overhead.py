"""What the runtime itself costs per step: our stages against the plain PyTorch step on the same
model, interleaved; then at world 2 against torch DDP and FSDP2.

    .venv/bin/python bench/runtime_overhead.py                       # 32 blocks x 64 wide: hooks dominate
    .venv/bin/python bench/runtime_overhead.py --shapes 4x64 --stages 0,3 --world2 0
    .venv/bin/python bench/runtime_overhead.py --layers 8 --width 512 --shapes 1x128 --world2 0
    .venv/bin/python bench/runtime_overhead.py --guard both --world2 0   # each stage with the guard on and off

World 1: at one rank every collective is a local no-op, so the difference from the plain step is
the runtime's Python: hooks, flat-buffer bookkeeping, the sharded optimizer's segments. A thin, deep
model makes that the largest share of the step. Every shape (batch x seq) and stage is one
candidate; each round times one step of every candidate in turn (per shape: plain, then each
stage), after three warm-up steps each, so all the ratios come from one interleaved run. Printed
are the median step time of each and its ratio to the plain step of its shape.

World 2 (``--world2``, the first shape's batch and seq per rank): ``zeroshard bench`` on the same
model, stages 0 and 3 against torch DDP, FSDP2 and the single-process step, interleaved. Stage 3's
excess over the single process is split into the runtime's host work (stage 3's excess over the
plain step at world 1, same shape) and the rest: the collectives' latency and the waits on them.

``--guard both`` adds each stage with the non-finite guard off (``guard.configure(enabled=False)``): the
plain step checks nothing, and without clipping the guard computes the grad norm itself every step.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import get_engine, guard
from zeroshard.trainer.step import one_step, plain_step


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(b), int(t)) for b, t in (s.lower().split("x") for s in text.split(","))]
    except ValueError:
        raise SystemExit(f"--shapes takes BATCHxSEQ[,BATCHxSEQ...], e.g. 1x16,4x64; got {text!r}") from None


def world1(args, stages: list[int]) -> dict[tuple[int, int], dict[str, float]]:
    """Median step seconds of plain and each stage, per shape, from one interleaved run."""
    steps = {}
    for batch, seq in _shapes(args.shapes):
        cfg = GPTConfig.named("tiny", n_layer=args.layers, n_embd=args.width, seq_len=seq)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        plain = GPT(cfg)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        steps[(batch, seq), "plain PyTorch"] = lambda m=plain, o=plain_opt, x=x: plain_step(m, o, x, x)
        for stage in stages:
            for guarded in (True, False) if args.guard == "both" else (True,):
                torch.manual_seed(0)
                model = zs.shard(GPT(cfg), stage=stage)
                opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, foreach=True)
                guard.configure(get_engine(model), enabled=guarded)
                name = f"zeroshard stage {stage}" + ("" if guarded else ", guard off")
                steps[(batch, seq), name] = lambda m=model, o=opt, x=x: one_step(m, o, x, x)
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict = {key: [] for key in steps}
    for _ in range(args.rounds):
        for key, step in steps.items():
            start = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - start)
    out: dict[tuple[int, int], dict[str, float]] = {}
    for (shape, name), ts in times.items():
        out.setdefault(shape, {})[name] = statistics.median(ts)
    return out


def world2(args, host_s: float | None) -> None:
    from zeroshard.tools.benchmark import BenchSpec, run_bench

    batch, seq = _shapes(args.shapes)[0]
    spec = BenchSpec(model="tiny", world=2, batch=batch, seq=seq, layers=args.layers, width=args.width,
                     rounds=args.world2_rounds, only=("stage0", "stage3"))
    print(f"\nworld 2, B={batch}/rank, T={seq}: the same as "
          f"`zeroshard bench --model tiny --layers {args.layers} --width {args.width} --world 2 --batch {batch} "
          f"--seq {seq} --only stage0,stage3 --rounds {args.world2_rounds}`")
    rows = {r["name"]: r for r in run_bench(spec)}
    for name, row in rows.items():
        print(f"  {name:<20} {row['median_step_s'] * 1e3:7.1f} ms   tokens/s {row['tokens_per_s']:9.0f}")
    s0, s3 = rows["zeroshard stage 0"], rows["zeroshard stage 3"]
    floor = rows["floor (1 process)"]["median_step_s"]
    print(f"  stage 3 vs FSDP2 (tokens/s)      {s3['vs_fsdp2']:.3f}")
    print(f"  stage 0 vs torch DDP (tokens/s)  {s0['vs_torch_ddp']:.3f}")
    print(f"  stage 3 x the single process     {s3['x_floor']:.3f}")
    if host_s is not None:
        excess = s3["median_step_s"] - floor
        comm = excess - host_s
        print(f"  stage 3's excess over the single process {excess * 1e3:.1f} ms: runtime host work "
              f"{host_s * 1e3:.1f} ms ({host_s / excess:.0%}), collectives and waits {comm * 1e3:.1f} ms "
              f"({comm / excess:.0%})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--shapes", default="1x16,4x64", help="batch x seq per shape, comma-separated")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--guard", choices=("on", "both"), default="on",
                   help="both: each stage also with the non-finite guard off")
    p.add_argument("--world2", type=int, default=1, help="1: also the world-2 comparison (0 skips it)")
    p.add_argument("--world2-rounds", type=int, default=5)
    args = p.parse_args()
    print("$ " + shlex.join([sys.executable, *sys.argv]))
    torch.set_num_threads(1)
    zs.init()
    stages = [int(s) for s in args.stages.split(",")]
    medians = world1(args, stages)
    print(f"{args.layers} blocks x {args.width} wide, one rank, {args.rounds} interleaved rounds")
    for (batch, seq), row in medians.items():
        base = row["plain PyTorch"]
        print(f" B={batch}, T={seq}")
        for name, median in row.items():
            print(f"  {name:<18} {median * 1e3:7.1f} ms   x plain {median / base:.3f}")
    zs.shutdown()
    if args.world2:
        first = medians[_shapes(args.shapes)[0]]
        host = first["zeroshard stage 3"] - first["plain PyTorch"] if "zeroshard stage 3" in first else None
        world2(args, host)


if __name__ == "__main__":
    main()
