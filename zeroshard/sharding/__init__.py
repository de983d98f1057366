"""The sharded runtime: one engine for DDP (stage 0) and ZeRO stages 1, 2 and 3."""

from __future__ import annotations

import contextlib
from typing import Callable

from torch import nn

from zeroshard.comm.mesh import get_mesh
from zeroshard.comm.quant import CommQuant
from zeroshard.offload import OffloadPolicy, make_store
from zeroshard.sharding.clip import clip_grad_norm_, grad_norm
from zeroshard.sharding.compiled import (CompileArg, CompileError, compile_forwards, compile_options,
                                         refuse_compiled_wrapper)
from zeroshard.sharding.engine import Engine, ExecutionOrderError, attach_engine, find_engine, get_engine
from zeroshard.sharding.flat import StagePolicy
from zeroshard.sharding.optim import optim_groups, optimizer
from zeroshard.sharding.manifest import precision_manifest
from zeroshard.sharding.precision import MixedPrecision
from zeroshard.sharding.recompute import Recompute, segment_length
from zeroshard.sharding.scaler import ShardedGradScaler
from zeroshard.sharding.state import full_state_dict, unsharded
from zeroshard.sharding.wrap import UnitsArg, plan_units, validate_params


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Run micro-steps whose gradients accumulate without synchronising across ranks.

    Backward passes inside the block add into the local gradients; the first backward outside it
    reduces the accumulated sum. What "local" means per stage is set by ``shard(accumulation=)``.
    """
    engine = get_engine(model)
    previous, engine.sync_grads = engine.sync_grads, False
    try:
        yield
    finally:
        engine.sync_grads = previous


def shard(model: nn.Module, *, stage: int, units: UnitsArg = None, mp: MixedPrecision | None = None,
          reshard_after_forward: bool = True, prefetch: int = 1, bucket_mb: float = 25.0,
          accumulation: str = "sharded", init_fn: Callable[[nn.Module], None] | None = None,
          skip_init: bool = False, checkpointing: str = "none", offload: OffloadPolicy | str | None = None,
          comm: CommQuant | None = None, compile: CompileArg = None) -> nn.Module:
    """Shard ``model`` in place for ``stage`` (0 = DDP, 1-3 = ZeRO) and return it.

    ``units`` picks the modules communicated together (default: the repeated blocks); the root
    unit takes the rest. ``bucket_mb`` groups units into reduction buckets for stages 0-2;
    ``prefetch`` and ``reshard_after_forward`` apply to stage 3. See docs/runtime.md.

    ``accumulation`` decides what stages 2-3 do inside ``zs.no_sync``: ``"sharded"`` (default)
    reduce-scatters every micro-step into the 1/N fp32 grad shard, so grad memory stays
    4·P/N bytes at the cost of one reduce-scatter of P per micro-step; ``"unsharded"`` keeps a full
    grad buffer in ``reduce_dtype`` across micro-steps (P × its size per rank, e.g. 4·P bytes in
    fp32) and reduce-scatters once per optimizer step, cutting reduce traffic by G. Stages 0-1
    always keep full grads, so for them ``no_sync`` simply defers the reduction.

    A model built on the meta device is materialised here, shard by shard, by replaying its init
    (``init_fn``, default ``model.init_weights()`` or every module's ``reset_parameters()``); see
    zeroshard/materialize.py. The values are bitwise those of a plain build under the same seed.
    ``skip_init=True`` leaves them at zero instead, for a checkpoint load that fills them next.

    ``checkpointing`` recomputes block activations in backward: "none", "all", "every:K" or
    "sqrt" (segments of about √L blocks); see zeroshard/sharding/recompute.py.
    ``offload`` moves fp32 masters and optimizer state off the compute device: "cpu" (host
    memory, CPU optimizer step) or an ``OffloadPolicy(kind="disk", directory=...)``; see
    zeroshard/offload/.

    ``comm=CommQuant(weights=True)`` sends stage 3's weight all-gather as blockwise int8 plus one
    fp32 scale per block (zeroshard/comm/quant.py); fp32 masters stay exact on their owner.

    ``compile`` runs each block's forward through ``torch.compile`` (the root's when there are no
    blocks), with the runtime's hooks outside the graphs: True (inductor), a backend name such as
    ``"aot_eager"``, or a dict of torch.compile arguments. See docs/compile.md.
    """
    segment_length(checkpointing, 1)  # validate the policy before touching the model
    compile_kwargs = compile_options(compile)
    refuse_compiled_wrapper(model)
    offload = OffloadPolicy(kind=offload) if isinstance(offload, str) else (offload or OffloadPolicy())
    if accumulation not in ("sharded", "unsharded"):
        raise ValueError(f"accumulation must be 'sharded' or 'unsharded', got {accumulation!r}")
    policy = StagePolicy(stage)
    if comm is not None:
        comm.check_stage(stage)
    if find_engine(model) is not None:
        raise ValueError("this model is already sharded; build a fresh model to shard it again")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 (all-gathers in flight ahead of compute), got {prefetch}")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    device = validate_params(model)
    mesh = get_mesh()
    if device.type not in (mesh.device.type, "meta"):
        model.to(mesh.device)
    specs = plan_units(model, units)
    engine = Engine(model, specs, policy=policy, mesh=mesh, mp=mp or MixedPrecision(), device=mesh.device,
                    prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                    bucket_bytes=int(bucket_mb * 2**20), accumulation=accumulation,
                    store=make_store(offload, mesh.device, mesh.rank), comm=comm)
    engine.offload = offload
    attach_engine(model, engine)
    blocks = [spec.module for spec in specs if not spec.is_root]
    if compile_kwargs is not None:
        # Before checkpointing is installed, so that a checkpointed unit wraps its compiled forward.
        compile_forwards(blocks or [model], compile_kwargs)
    if segment_length(checkpointing, len(blocks)) is not None:
        engine.recompute = Recompute(model, blocks, checkpointing, engine if policy.shard_params else None)
    if device.type == "meta":
        from zeroshard.materialize import materialize

        engine.init_stats = materialize(model, engine, (lambda m: None) if skip_init else init_fn,
                                        require_all=not skip_init)
    else:
        engine.init_stats = {"path": "replicated", "peak_temp_bytes": 0}
    return model


__all__ = [
    "CommQuant", "CompileError", "Engine", "ExecutionOrderError",
    "MixedPrecision", "ShardedGradScaler", "StagePolicy", "clip_grad_norm_", "full_state_dict",
    "get_engine", "grad_norm", "no_sync", "optim_groups", "optimizer", "precision_manifest", "shard", "unsharded",
]
