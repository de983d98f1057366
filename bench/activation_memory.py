"""Activation memory per checkpointing policy, measured with torch's MemTracker.

    .venv/bin/python bench/activation_memory.py --model small --batch 4 --seq 256

Prints activation bytes kept after forward and at the step's peak for none / every:2 / sqrt /
all, for the model's own depth L and for 4L (same width), so the O(L) vs O(√L) growth shows.
"""

from __future__ import annotations


import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.observing.profile.activations import activation_bytes
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path

POLICIES = ("none", "every:2", "sqrt", "all")


def measure(cfg: GPTConfig, policy: str, batch: int, seq: int) -> dict:
    mesh = zs.init()
    torch.manual_seed(0)
    model = zs.shard(GPT(cfg), stage=0, checkpointing=policy)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    model(x, x).backward()
    return activation_bytes(model, lambda: model(x, x), mesh.device)


def main() -> None:
    args = bench_parser(__doc__, model="small", batch=4, seq=256).parse_args()
    base = GPTConfig.named(args.model, seq_len=args.seq)
    mib = 2**20
    for depth in (base.n_layer, 4 * base.n_layer):
        cfg = GPTConfig.named(args.model, seq_len=args.seq, n_layer=depth)
        print(f"{args.model} width {cfg.n_embd}, L={depth}, batch {args.batch} x {args.seq} tokens")
        for policy in POLICIES:
            r = measure(cfg, policy, args.batch, args.seq)
            print(f"  {policy:>8}: kept after forward {r['kept_after_forward'] / mib:8.1f} MiB"
                  f"   peak {r['peak'] / mib:8.1f} MiB")


if __name__ == "__main__":
    main()
