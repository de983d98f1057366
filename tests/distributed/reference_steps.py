"""The numerical ground truth the parity tests compare a sharded run with: plain single-process PyTorch,
AdamW over zs.optim_groups (decay and no-decay), the global batch sampler's batches at world 1 and
grad-norm clipping, step after step. Module level so every workloads module shares one copy."""

from __future__ import annotations

from typing import Callable

import torch

import zeroshard as zs
from zeroshard.trainer.data import GlobalBatchSampler, collate


def plain_adamw_steps(model: torch.nn.Module, data, loss_of: Callable, *, steps: int, global_batch: int, seed: int,
                      lr: float, weight_decay: float, clip: float, eps: float = 1e-8) -> list[float]:
    """Train ``model`` ``steps`` steps in place; each step's loss (``loss_of(model, x, y)``)."""
    opt = torch.optim.AdamW(zs.optim_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95), eps=eps)
    sampler = GlobalBatchSampler(len(data), global_batch, world=1, rank=0, seed=seed)
    losses = []
    for _ in range(steps):
        x, y = collate(data, sampler.next_indices())
        loss = loss_of(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
