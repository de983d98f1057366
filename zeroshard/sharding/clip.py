"""Global gradient-norm clipping over every shard."""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.comm import collectives
from zeroshard.sharding.engine import get_engine


def grad_norm(model: nn.Module) -> torch.Tensor:
    """The global L2 norm of the averaged gradient, the same on every rank.

    Squares are summed in float64: an fp32 square is exact in fp64, so the total barely depends on
    how the elements are split across ranks, and the fp32 result is the same for DDP and every
    ZeRO stage. Replicas (hybrid sharding) hold identical shards, so only the shard group is summed;
    a tied param has one storage and is counted once.
    """
    engine = get_engine(model)
    device = engine.mesh.device
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for group in engine.trainable_groups:
        if group.grad_shard is not None:
            total += group.grad_shard.double().square().sum()
    if engine.policy.shard_optimizer and engine.mesh.shard_size > 1:
        collectives.all_reduce(total, group="shard", phase="clip")
    return total.sqrt().to(torch.float32).squeeze(0)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale the gradient shards so the global norm is at most ``max_norm``; return the norm before clipping."""
    norm = grad_norm(model)
    # Same arithmetic as torch.nn.utils.clip_grad_norm_: always multiply by the clamped coefficient.
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for group in get_engine(model).trainable_groups:
        if group.grad_shard is not None:
            group.grad_shard.mul_(coef.to(group.grad_shard.dtype))
    return norm
