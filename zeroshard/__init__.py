"""zeroshard: sharded data-parallel training for PyTorch (DDP and ZeRO-1/2/3 in one runtime)."""

from zeroshard.comm import get_ledger as ledger
from zeroshard.comm.mesh import Mesh, get_mesh, init, shutdown
from zeroshard.sharding import (
    MixedPrecision,
    clip_grad_norm_,
    full_state_dict,
    grad_norm,
    optim_groups,
    optimizer,
    shard,
    unsharded,
)

__version__ = "0.1.0"

__all__ = [
    "Mesh", "MixedPrecision", "clip_grad_norm_", "full_state_dict", "get_mesh", "grad_norm", "init", "ledger",
    "optim_groups", "optimizer", "shard", "shutdown", "unsharded",
]
