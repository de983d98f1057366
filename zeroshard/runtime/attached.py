"""Which engine runs a model: the one link from a plain ``nn.Module`` to its runtime.

Apart from the engine so that modules the engine imports (tensor parallelism, which must refuse a
model that is already sharded) can ask without importing the engine back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from zeroshard.runtime.engine import Engine

_ENGINE_ATTR = "_zeroshard_engine"  # on the model; a private name so it never clashes with a user's


def attach_engine(model: nn.Module, engine: Engine) -> None:
    """Record ``engine`` as the runtime of ``model`` (what ``get_engine`` returns)."""
    setattr(model, _ENGINE_ATTR, engine)


def find_engine(model: nn.Module) -> Engine | None:
    """The engine of a sharded model, or None for a plain one."""
    return getattr(model, _ENGINE_ATTR, None)


def get_engine(model: nn.Module) -> Engine:
    engine = find_engine(model)
    if engine is None:
        raise ValueError("this model is not sharded: call zs.shard(model, ...) first")
    return engine
