"""Worker functions for the distributed tests (module level so spawned processes can import them).

Each worker runs many cases inside one process group and returns plain data to the parent, because
starting a gloo world costs seconds per process on this machine.
"""

from __future__ import annotations

import torch

import zeroshard as zs
from zeroshard.data import GlobalBatchSampler, build_dataset, collate
from zeroshard.models import GPT, GPTConfig

SEED = 1234
LR = 3e-3
WEIGHT_DECAY = 0.1
CLIP = 1.0


def tiny_setup(global_batch: int, seq_len: int = 32, num_samples: int = 256):
    cfg = GPTConfig.named("tiny", seq_len=seq_len)
    data = build_dataset(seq_len=seq_len, num_samples=num_samples, seed=SEED)
    return cfg, data


def reference_run(steps: int, global_batch: int) -> dict:
    """Plain single-process PyTorch: the numerical ground truth."""
    cfg, data = tiny_setup(global_batch)
    torch.manual_seed(SEED)
    model = GPT(cfg)
    opt = torch.optim.AdamW(zs.optim_groups(model, WEIGHT_DECAY), lr=LR, betas=(0.9, 0.95))
    sampler = GlobalBatchSampler(len(data), global_batch, world=1, rank=0, seed=SEED)
    losses = []
    for _ in range(steps):
        x, y = collate(data, sampler.next_indices())
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def sharded_run(stage: int, steps: int, global_batch: int, *, mp=None, prefetch: int = 1,
                reshard_after_forward: bool = True, bucket_mb: float = 25.0) -> dict:
    mesh = zs.init()
    cfg, data = tiny_setup(global_batch)
    torch.manual_seed(SEED)
    model = zs.shard(GPT(cfg), stage=stage, mp=mp, prefetch=prefetch,
                     reshard_after_forward=reshard_after_forward, bucket_mb=bucket_mb)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
    sampler = GlobalBatchSampler(len(data), global_batch, world=mesh.world, rank=mesh.rank, seed=SEED)
    ledger = zs.ledger()
    losses, step_bytes = [], []
    for _ in range(steps):
        x, y = collate(data, sampler.next_indices())
        before = {op: ledger.total_bytes(op) for op in ("all_reduce", "reduce_scatter", "all_gather")}
        loss = model(x, y)
        loss.backward()
        zs.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()
        step_bytes.append({op: ledger.total_bytes(op) - b for op, b in before.items()})
        mean_loss = loss.detach().clone()
        zs.comm.collectives.all_reduce(mean_loss, op="avg", phase="metrics")
        losses.append(mean_loss.item())
    return {"losses": losses, "params": zs.full_state_dict(model), "step_bytes": step_bytes}
