"""How many bytes of state an optimizer keeps per parameter, found by running it.

"Adam = 12 bytes" is a model, not a constant: AdamW with bf16 params keeps bf16
moments, SGD without momentum keeps nothing, an 8-bit optimizer keeps 1-byte moments plus block
scales. So we build the real optimizer class over two small tensors of the master dtype, run one
``step()``, and read the state's storage sizes. Two sizes give a line: bytes = a·numel + b, where
``a`` is the per-element cost (moments, including any per-block scale metadata) and ``b`` the
per-tensor cost (AdamW's ``step`` counter, which the runtime pays once per optimizer segment).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from zeroshard.runtime.optim_kinds import PER_TENSOR_OPTIMIZERS

# Multiples of every common quantisation block (64 ... 4096) so block scales divide evenly.
_SIZES = (4096, 16384)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimStateCost:
    """Optimizer state cost for params of one dtype: ``per_element·numel + per_tensor`` bytes."""

    optimizer: str
    dtype: torch.dtype
    per_element: float
    per_tensor: int
    state: tuple[tuple[str, str], ...]
    """(state name, dtype) pairs seen, e.g. (("exp_avg", "float32"), ("step", "float32"))."""

    def __post_init__(self) -> None:
        if self.per_element < 0 or self.per_tensor < 0:
            raise ValueError(f"{self.optimizer} state cost came out negative ({self.per_element}/elem, "
                             f"{self.per_tensor}/tensor); its state does not grow linearly with the param size")

    def bytes_for(self, numel: float, tensors: int) -> int:
        return int(round(self.per_element * numel)) + self.per_tensor * tensors


def _state_bytes(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[int, dict[str, str]]:
    total, names = 0, {}
    for key, value in optimizer.state[param].items():
        if isinstance(value, torch.Tensor):
            total += value.untyped_storage().nbytes()
            names[str(key)] = str(value.dtype).removeprefix("torch.")
    return total, names


def _one_step(optim_cls: type, kwargs: tuple, dtype: torch.dtype, numel: int) -> tuple[int, dict[str, str]]:
    generator = torch.Generator().manual_seed(0)
    # A per-tensor class steps whole matrices on owners (Muon takes nothing else): probe a square one.
    side = int(numel ** 0.5)
    shape = (side, numel // side) if optim_cls in PER_TENSOR_OPTIMIZERS else (numel,)
    param = torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
    param.grad = torch.randn(shape, generator=generator).to(dtype)
    options = dict(kwargs)
    options.setdefault("lr", 1e-3)  # some optimizers have no default learning rate
    optimizer = optim_cls([param], **options)
    optimizer.step()
    return _state_bytes(optimizer, param)


@functools.lru_cache(maxsize=None)
def _probe_cached(optim_cls: type, kwargs: tuple, dtype: torch.dtype) -> OptimStateCost:
    (small, names), (large, _) = (_one_step(optim_cls, kwargs, dtype, n) for n in _SIZES)
    per_element = (large - small) / (_SIZES[1] - _SIZES[0])
    per_tensor = int(round(small - per_element * _SIZES[0]))
    return OptimStateCost(optimizer=optim_cls.__name__, dtype=dtype, per_element=per_element,
                          per_tensor=per_tensor, state=tuple(sorted(names.items())))


def probe(optim_cls: type, dtype: torch.dtype, kwargs: dict[str, Any] | None = None) -> OptimStateCost:
    """Run one ``optim_cls.step()`` on small ``dtype`` tensors and return the state's cost model."""
    # Lists (betas=[0.9, 0.95] from a config file) become tuples so the result can be cached.
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (kwargs or {}).items()))
    return _probe_cached(optim_cls, frozen, dtype)
