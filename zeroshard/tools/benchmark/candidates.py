"""The contestants: one training step each, on the same model, data, batch and precision.

Each candidate owns its model and optimizer and exposes ``step(x, y)``. Ours takes the step
``zeroshard train`` takes; peers (torch DDP, FSDP2) are built with torch's own APIs and stepped as
their users would (``zeroshard.trainer.step.plain_step``); the floor is that step with no distribution.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from zeroshard.comm.mesh import get_mesh
from zeroshard.runtime import CommQuant, MixedPrecision, optimizer as zs_optimizer, shard
from zeroshard.models import GPT, GPTConfig
from zeroshard.trainer.step import IGNORE_INDEX, one_step, plain_step


@dataclasses.dataclass
class Candidate:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ours: bool = False


def _adamw(params, lr: float = 3e-4):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=True)


def _build(cfg: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).to(get_mesh().device)


def _plain(name: str, model: nn.Module, autocast_dtype) -> Candidate:
    opt = _adamw(model.parameters())
    return Candidate(name, model, opt, _plain_step(model, opt, autocast_dtype))


def _plain_step(model: nn.Module, opt, autocast_dtype):
    def step(x, y):
        return plain_step(model, opt, x, y, autocast_dtype=autocast_dtype)
    return step


def floor(cfg: GPTConfig, seed: int, dtype: torch.dtype) -> Candidate:
    """Single-process compute of the same micro-batch: no communication, no hooks."""
    return _plain("floor (1 process)", _build(cfg, seed), None if dtype == torch.float32 else dtype)


def sharded_step(model: nn.Module, opt):
    """One training step of a ``zs.shard`` model, the step ``zeroshard train`` takes
    (zeroshard/trainer/step.py) without clipping, as the peers do not clip. Precision is the model's own,
    so no autocast. Returns this rank's mean token loss."""
    def step(x, y):
        out = one_step(model, opt, x, y)
        return out.loss_sum / (y != IGNORE_INDEX).sum()
    return step


def ours(cfg: GPTConfig, seed: int, dtype: torch.dtype, stage: int, comm: CommQuant | None = None) -> Candidate:
    mp = None if dtype == torch.float32 else MixedPrecision(param_dtype=dtype)
    model = shard(_build(cfg, seed), stage=stage, mp=mp, comm=comm)
    opt = zs_optimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1, foreach=True)
    name = f"zeroshard stage {stage}" + (" qwZ+qgZ" if comm is not None and comm.enabled else "")
    return Candidate(name, model, opt, sharded_step(model, opt), ours=True)


def torch_ddp(cfg: GPTConfig, seed: int, dtype: torch.dtype) -> Candidate:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_build(cfg, seed))
    return _plain("torch DDP", model, None if dtype == torch.float32 else dtype)


def fsdp2(cfg: GPTConfig, seed: int, dtype: torch.dtype, reshard_after_forward: bool) -> Candidate:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _build(cfg, seed)
    mesh = init_device_mesh(get_mesh().device.type, (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy() if dtype == torch.float32 else MixedPrecisionPolicy(param_dtype=dtype,
                                                                                  reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return _plain("FSDP2" if reshard_after_forward else "FSDP2 (no reshard)", model, None)
