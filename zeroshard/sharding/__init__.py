"""The sharded runtime: one engine for DDP (stage 0) and ZeRO stages 1, 2 and 3."""

from __future__ import annotations

from torch import nn

from zeroshard.comm.mesh import get_mesh
from zeroshard.sharding.clip import clip_grad_norm_, grad_norm
from zeroshard.sharding.engine import Engine, ExecutionOrderError, get_engine
from zeroshard.sharding.flat import StagePolicy
from zeroshard.sharding.optim import optim_groups, optimizer
from zeroshard.sharding.precision import MixedPrecision
from zeroshard.sharding.state import full_state_dict, unsharded
from zeroshard.sharding.wrap import UnitsArg, plan_units, validate_params


def shard(model: nn.Module, *, stage: int, units: UnitsArg = None, mp: MixedPrecision | None = None,
          reshard_after_forward: bool = True, prefetch: int = 1, bucket_mb: float = 25.0) -> nn.Module:
    """Shard ``model`` in place for ``stage`` (0 = DDP, 1-3 = ZeRO) and return it.

    ``units`` picks the modules communicated together (default: the repeated blocks); the root
    unit takes the rest. ``bucket_mb`` groups units into reduction buckets for stages 0-2;
    ``prefetch`` and ``reshard_after_forward`` apply to stage 3. See docs/runtime.md.
    """
    policy = StagePolicy(stage)
    if getattr(model, "_zeroshard_engine", None) is not None:
        raise ValueError("this model is already sharded; build a fresh model to shard it again")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 (all-gathers in flight ahead of compute), got {prefetch}")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    device = validate_params(model)
    mesh = get_mesh()
    if device.type != mesh.device.type:
        model.to(mesh.device)
    specs = plan_units(model, units)
    engine = Engine(model, specs, policy=policy, mesh=mesh, mp=mp or MixedPrecision(), device=mesh.device,
                    prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                    bucket_bytes=int(bucket_mb * 2**20))
    model._zeroshard_engine = engine
    return model


__all__ = [
    "Engine", "ExecutionOrderError", "MixedPrecision", "StagePolicy", "clip_grad_norm_", "full_state_dict",
    "get_engine", "grad_norm", "optim_groups", "optimizer", "shard", "unsharded",
]
