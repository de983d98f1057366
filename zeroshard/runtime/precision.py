"""Mixed-precision policy: which dtype each role of a tensor uses."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Four dtypes, one per role, because one "precision" flag hides which role loses precision.

    The fp32 master copy always lives in the optimizer shard; ``param_dtype`` is only what forward
    and backward compute in and what the all-gather moves.
    """

    param_dtype: torch.dtype | None = None
    """Compute dtype of the unsharded params and of the all-gather. None keeps the params' own dtype."""
    reduce_dtype: torch.dtype | None = torch.float32
    """Dtype of gradient reduction (all-reduce / reduce-scatter). None reduces in ``param_dtype``."""
    buffer_dtype: torch.dtype | None = None
    """Dtype of module buffers. None leaves buffers alone."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecision.{name} must be a floating torch.dtype or None, got {value!r}")

    def compute_dtype(self, master_dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype or master_dtype

    def reduction_dtype(self, master_dtype: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or self.compute_dtype(master_dtype)


FULL_PRECISION = MixedPrecision(reduce_dtype=None)


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """Accept 'fp32'/'bf16'/'fp16' (and torch spellings) from configs and flags."""
    if name is None or isinstance(name, torch.dtype):
        return name
    table = {
        "fp32": torch.float32, "float32": torch.float32,
        "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
        "fp16": torch.float16, "float16": torch.float16,
    }
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16") from None
