"""What the runtime itself costs per step, with no communication: one rank, our step against the
plain PyTorch step on the same model, interleaved.

    .venv/bin/python bench/runtime_overhead.py                       # 32 blocks x 64 wide: hooks dominate
    .venv/bin/python bench/runtime_overhead.py --layers 8 --width 512 --stages 0,3

At world 1 every collective is a local no-op, so the difference from the plain step is the
runtime's Python: hooks, flat-buffer bookkeeping, the sharded optimizer's segments. A thin, deep
model makes that the largest share of the step. Each round times one step of every candidate in
turn (plain, then each stage), after three warm-up steps each; printed are the median step time
of each and its ratio to the plain step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.trainer.step import one_step, plain_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--stages", default="0,3")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    zs.init()
    cfg = GPTConfig.named("tiny", n_layer=args.layers, n_embd=args.width, seq_len=args.seq)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    steps = {}
    torch.manual_seed(0)
    plain = GPT(cfg)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    steps["plain PyTorch"] = lambda: plain_step(plain, plain_opt, x, x)
    for stage in (int(s) for s in args.stages.split(",")):
        torch.manual_seed(0)
        model = zs.shard(GPT(cfg), stage=stage)
        opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, foreach=True)
        steps[f"zeroshard stage {stage}"] = lambda model=model, opt=opt: one_step(model, opt, x, x)
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain PyTorch"])
    print(f"{args.layers} blocks x {args.width} wide, B={args.batch}, T={args.seq}, one rank, {args.rounds} rounds")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"  {name:<18} {median * 1e3:7.1f} ms   x plain {median / base:.3f}")


if __name__ == "__main__":
    main()
