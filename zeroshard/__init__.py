"""zeroshard: sharded data-parallel training for PyTorch (DDP and ZeRO-1/2/3 in one runtime)."""
# ruff: noqa: F401  (the TYPE_CHECKING imports at the end only declare the names of __all__)

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# `import zeroshard` loads none of these: each name is imported on first use (PEP 562). A process
# that needs only part of the package (the launcher forking ranks, the CLI parsing its flags before
# anything starts, `zeroshard --version`) then does not pay for torch and the runtime up front.
_EXPORTS: dict[str, tuple[str, str]] = {
    "build_pretrained": ("zeroshard.checkpoint.hf", "build_pretrained"),
    "CheckpointError": ("zeroshard.checkpoint", "CheckpointError"),
    "clip_grad_norm_": ("zeroshard.runtime", "clip_grad_norm_"),
    "CommQuant": ("zeroshard.runtime", "CommQuant"),
    "context_parallel": ("zeroshard.parallel.cp", "apply_context_parallel"),
    "Dim": ("zeroshard.comm.names", "Dim"),
    "EngineOptions": ("zeroshard.runtime", "EngineOptions"),
    "expert_parallel": ("zeroshard.parallel.experts", "expert_parallel"),
    "export_pretrained": ("zeroshard.checkpoint.hf", "export_pretrained"),
    "full_state_dict": ("zeroshard.runtime", "full_state_dict"),
    "get_mesh": ("zeroshard.comm.mesh", "get_mesh"),
    "grad_norm": ("zeroshard.runtime", "grad_norm"),
    "Group": ("zeroshard.comm.names", "Group"),
    "init": ("zeroshard.comm.world", "init"),
    "ledger": ("zeroshard.comm", "get_ledger"),
    "load": ("zeroshard.checkpoint", "load"),
    "load_pretrained": ("zeroshard.checkpoint.hf", "load_pretrained"),
    "Mesh": ("zeroshard.comm.mesh", "Mesh"),
    "mesh_of": ("zeroshard.runtime", "mesh_of"),
    "meta_init": ("zeroshard.runtime.materialize", "meta_init"),
    "MixedPrecision": ("zeroshard.runtime", "MixedPrecision"),
    "MoELayer": ("zeroshard.parallel.experts", "MoELayer"),
    "ModelSpec": ("zeroshard.models.spec", "ModelSpec"),
    "spec_of": ("zeroshard.models.specs", "spec_of"),
    "muon_groups": ("zeroshard.runtime.recipes", "muon_groups"),
    "new_mesh": ("zeroshard.comm.world", "new_mesh"),
    "no_sync": ("zeroshard.runtime", "no_sync"),
    "observe": ("zeroshard.observing", "observe"),
    "Observer": ("zeroshard.observing", "Observer"),
    "OffloadPolicy": ("zeroshard.runtime.offload", "OffloadPolicy"),
    "optim_groups": ("zeroshard.runtime", "optim_groups"),
    "optimizer": ("zeroshard.runtime", "optimizer"),
    "ParallelDims": ("zeroshard.comm.dims", "ParallelDims"),
    "Phase": ("zeroshard.comm.names", "Phase"),
    "plan": ("zeroshard.tools.planner", "plan"),
    "precision_manifest": ("zeroshard.runtime", "precision_manifest"),
    "save": ("zeroshard.checkpoint", "save"),
    "shard": ("zeroshard.runtime", "shard"),
    "ShardedGradScaler": ("zeroshard.runtime", "ShardedGradScaler"),
    "shutdown": ("zeroshard.comm.mesh", "shutdown"),
    "tensor_parallel": ("zeroshard.parallel.tp", "tensor_parallel"),
    "unsharded": ("zeroshard.runtime", "unsharded"),
}
"""Public name -> (module, attribute there)."""

__all__ = sorted(_EXPORTS, key=str.lower)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # later lookups skip this function
        return value
    try:  # a subpackage not imported yet: zeroshard.runtime after a bare `import zeroshard`
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from zeroshard.checkpoint import CheckpointError, load, save  # type: ignore[no-redef]  # also module names there
    from zeroshard.comm import get_ledger as ledger
    from zeroshard.comm.mesh import Mesh, get_mesh, shutdown
    from zeroshard.comm.world import init, new_mesh
    from zeroshard.comm.dims import ParallelDims
    from zeroshard.comm.names import Dim, Group, Phase
    from zeroshard.parallel.experts import MoELayer, expert_parallel
    from zeroshard.parallel.cp import apply_context_parallel as context_parallel
    from zeroshard.checkpoint.hf import build_pretrained, export_pretrained, load_pretrained
    from zeroshard.runtime.materialize import meta_init
    from zeroshard.models.spec import ModelSpec
    from zeroshard.models.specs import spec_of
    from zeroshard.runtime.recipes import muon_groups
    from zeroshard.observing import Observer, observe
    from zeroshard.runtime.offload import OffloadPolicy
    from zeroshard.tools.planner import plan
    from zeroshard.runtime import (
        CommQuant,
        EngineOptions,
        MixedPrecision,
        ShardedGradScaler,
        clip_grad_norm_,
        full_state_dict,
        grad_norm,
        mesh_of,
        no_sync,
        optim_groups,
        optimizer,
        precision_manifest,
        shard,
        unsharded,
    )
    from zeroshard.parallel.tp import tensor_parallel
