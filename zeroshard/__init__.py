"""zeroshard: sharded data-parallel training for PyTorch (DDP and ZeRO-1/2/3 in one runtime)."""

from zeroshard.checkpoint import CheckpointError, load, save
from zeroshard.comm import get_ledger as ledger
from zeroshard.comm.mesh import Mesh, get_mesh, init, new_mesh, shutdown
from zeroshard.comm.names import Dim, Group, Phase
from zeroshard.experts import MoELayer, expert_parallel
from zeroshard.hf import build_pretrained, export_pretrained, load_pretrained
from zeroshard.materialize import meta_init
from zeroshard.observing import Observer, observe
from zeroshard.offload import OffloadPolicy
from zeroshard.planner import plan
from zeroshard.sharding import (
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
from zeroshard.sharding.tp import tensor_parallel

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CommQuant", "Dim", "EngineOptions", "Group", "Mesh", "Phase", "MixedPrecision",
    "OffloadPolicy", "ShardedGradScaler",
    "build_pretrained",
    "MoELayer", "clip_grad_norm_", "expert_parallel",
    "export_pretrained", "full_state_dict", "get_mesh", "grad_norm", "init", "ledger", "load",
    "load_pretrained", "mesh_of", "meta_init", "new_mesh", "no_sync", "Observer", "observe", "optim_groups",
    "optimizer", "plan", "precision_manifest", "save", "shard", "shutdown", "tensor_parallel", "unsharded",
]
