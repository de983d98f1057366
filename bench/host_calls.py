"""Python calls per training step, plain PyTorch against each stage, on one rank: the runtime's host
work counted rather than timed, so the figure does not move with the machine's load.

    .venv/bin/python bench/host_calls.py                        # 32 blocks x 64 wide, B=1, T=16
    .venv/bin/python bench/host_calls.py --top 25 --stages 3    # and stage 3's most called functions

cProfile counts every Python-level call and every call of a builtin (torch ops included) made
during ``--steps`` steps after three warm-up steps; printed are the calls per step, the difference
from the plain step per block (the blocks and the root: stage 3's units; stages 0-2 bucket them)
and, with ``--top``, the functions called most.
"""

from __future__ import annotations

import cProfile
import pstats

import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import get_engine
from zeroshard.trainer.step import one_step, plain_step
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path


def calls_per_step(step, steps: int, top: int = 0) -> float:
    for _ in range(3):
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    stats = pstats.Stats(profile)
    if top:
        stats.sort_stats("ncalls").print_stats(top)
    return sum(entry[1] for entry in stats.stats.values()) / steps  # type: ignore[attr-defined]


def main() -> None:
    args = bench_parser(__doc__, layers=32, width=64, batch=1, seq=16, stages="0,1,2,3", steps=5,
                        top=(0, "also print the N most called functions of each run")).parse_args()
    torch.set_num_threads(1)
    zs.init()
    cfg = GPTConfig.named("tiny", n_layer=args.layers, n_embd=args.width, seq_len=args.seq)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = GPT(cfg)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    base = calls_per_step(lambda: plain_step(plain, plain_opt, x, x), args.steps, args.top)
    print(f"{args.layers} blocks x {args.width} wide, B={args.batch}, T={args.seq}, one rank, {args.steps} steps")
    print(f"  plain PyTorch      {base:8.0f} calls/step")
    for stage in (int(s) for s in args.stages.split(",")):
        torch.manual_seed(0)
        model = zs.shard(GPT(cfg), stage=stage)
        opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, foreach=True)
        units = len(get_engine(model).units)
        calls = calls_per_step(lambda: one_step(model, opt, x, x), args.steps, args.top)
        print(f"  zeroshard stage {stage}  {calls:8.0f} calls/step   +{calls - base:6.0f} over plain, "
              f"{(calls - base) / (args.layers + 1):6.1f} per block ({units} units)")


if __name__ == "__main__":
    main()
