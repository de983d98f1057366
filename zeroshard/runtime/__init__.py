"""The sharded runtime: one engine for DDP (stage 0) and ZeRO stages 1, 2 and 3."""

from __future__ import annotations

import contextlib
from typing import Callable, cast

from torch import nn

from zeroshard.comm.mesh import Mesh, get_mesh
from zeroshard.comm.quant import CommQuant
from zeroshard.runtime.offload import OffloadPolicy
from zeroshard.runtime.clip import clip_grad_norm_, grad_norm
from zeroshard.runtime.compiled import (CompileArg, CompileError, compile_forwards, compile_options,
                                         refuse_compiled_wrapper)
from zeroshard.runtime.engine import Engine, ExecutionOrderError, attach_engine, find_engine, get_engine
from zeroshard.runtime.events import EngineEvent, EngineEvents, EventKind
from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.optim import optim_groups, optimizer
from zeroshard.runtime.manifest import precision_manifest
from zeroshard.runtime.options import EngineOptions
from zeroshard.runtime.precision import MixedPrecision
from zeroshard.runtime.scaler import ShardedGradScaler
from zeroshard.runtime.schedule_check import ScheduleCheck, ScheduleMismatchError
from zeroshard.runtime.state import full_state_dict, unsharded
from zeroshard.runtime.wrap import UnitsArg, plan_units, validate_params


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


def mesh_of(model: nn.Module) -> Mesh:
    """The mesh a sharded model communicates over (what ``zs.shard(mesh=)`` was given)."""
    return get_engine(model).mesh


def shard(model: nn.Module | Callable[[], nn.Module], *, stage: int, units: UnitsArg = None,
          mp: MixedPrecision | None = None,
          reshard_after_forward: bool = True, prefetch: int = 1, bucket_mb: float = 25.0,
          accumulation: str = "sharded", init_fn: Callable[[nn.Module], None] | None = None,
          skip_init: bool = False, checkpointing: str = "none", offload: OffloadPolicy | str | None = None,
          comm: CommQuant | None = None, options: EngineOptions | None = None,
          compile: CompileArg = None, mesh: Mesh | None = None) -> nn.Module:
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
    zeroshard/runtime/materialize.py. The values are bitwise those of a plain build under the same seed.
    ``skip_init=True`` leaves them at zero instead, for a checkpoint load that fills them next.
    ``model`` may instead be a function that builds it (``lambda: MyModel(cfg)``): the constructor
    runs for real, one param at a time, and each rank keeps only its slices, bitwise those of
    ``MyModel(cfg)`` under the same seed, with no ``init_fn``; see zeroshard/runtime/construct.py. Use the
    returned model.

    ``checkpointing`` recomputes block activations in backward: "none", "all", "every:K" or
    "sqrt" (segments of about √L blocks); see zeroshard/runtime/recompute.py.
    ``offload`` moves fp32 masters and optimizer state off the compute device: "cpu" (host
    memory, CPU optimizer step) or an ``OffloadPolicy(kind="disk", directory=...)``; see
    zeroshard/runtime/offload/.

    ``comm=CommQuant(weights=True)`` sends stage 3's weight all-gather as blockwise int8 plus one
    fp32 scale per block (zeroshard/comm/quant.py); fp32 masters stay exact on their owner.

    ``options`` takes all of the engine's knobs as one ``EngineOptions`` instead (including the
    reduction overlap ones that have no keyword here); then the keywords it covers must be left
    at their defaults.

    ``compile`` runs each block's forward through ``torch.compile`` (the root's when there are no
    blocks), with the runtime's hooks outside the graphs: True (inductor), a backend name such as
    ``"aot_eager"``, or a dict of torch.compile arguments. See docs/compile.md.

    ``mesh`` is the parallel context the model is sharded over: the one ``zs.init`` built by
    default, or one from ``zs.new_mesh`` so that models sharded over different layouts live in one
    process. Every collective of this model then runs on that mesh's groups.
    """
    keywords = EngineOptions(prefetch=prefetch, reshard_after_forward=reshard_after_forward, bucket_mb=bucket_mb,
                             accumulation=accumulation, checkpointing=checkpointing,
                             offload=offload)  # type: ignore[arg-type]  # a kind name is taken too
    # (constructing it validated them, before the model is touched)
    if options is None:
        options = keywords
    elif keywords != EngineOptions():
        raise ValueError("zs.shard got options= and also engine keywords (prefetch, reshard_after_forward, bucket_mb, "
                         "accumulation, checkpointing, offload); put them all in the EngineOptions")
    compile_kwargs = compile_options(compile)
    policy = StagePolicy(stage)
    if comm is not None:
        comm.check_stage(policy)
    # A build function runs here, now that the arguments are checked.
    built = None if isinstance(model, nn.Module) else _build(model, init_fn, skip_init)
    model = built.model if built is not None else cast(nn.Module, model)
    refuse_compiled_wrapper(model)
    if find_engine(model) is not None:
        raise ValueError("this model is already sharded; build a fresh model to shard it again")
    device = validate_params(model)
    mesh = mesh or get_mesh()
    if device.type not in (mesh.device.type, "meta"):
        model.to(mesh.device)
    specs = plan_units(model, units)
    if compile_kwargs is not None:
        # Before the engine installs activation checkpointing, so that a checkpointed unit wraps
        # its compiled forward.
        compile_forwards([spec.module for spec in specs if not spec.is_root] or [model], compile_kwargs)
    engine = Engine(model, specs, policy=policy, mesh=mesh, mp=mp or MixedPrecision(), device=mesh.device,
                    options=options, comm=comm)
    attach_engine(model, engine)
    if options.check_schedule:
        ScheduleCheck(engine)  # lives as long as the hooks it registers on the model and its events
    if built is not None:
        built.move_buffers(mesh.device)
        engine.replay_constructor(built)
    elif device.type == "meta":
        engine.materialize((lambda m: None) if skip_init else init_fn, require_all=not skip_init)
    return model


def _build(build, init_fn, skip_init: bool):
    """Run a build callable under constructor replay (zeroshard/runtime/construct.py)."""
    if not callable(build):
        raise ValueError(f"zs.shard takes an nn.Module or a function that builds one, got {type(build).__name__}")
    if init_fn is not None or skip_init:
        raise ValueError("init_fn and skip_init apply to a model built on meta; with a build function the "
                         "constructor itself is the init, so drop them (or pass a meta model instead)")
    from zeroshard.runtime.construct import record_build

    return record_build(build)


__all__ = [
    "CommQuant", "CompileError", "Engine", "EngineEvent", "EngineEvents", "EngineOptions", "EventKind",
    "ExecutionOrderError", "ScheduleMismatchError",
    "MixedPrecision", "ShardedGradScaler", "StagePolicy", "clip_grad_norm_", "full_state_dict",
    "get_engine", "grad_norm", "mesh_of", "no_sync", "optim_groups", "optimizer", "precision_manifest", "shard", "unsharded",
]
