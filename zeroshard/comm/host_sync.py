"""Host syncs, counted and named: every deliberate read of a device tensor on the host goes here.

On CUDA a read of a tensor's value on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool``)
waits for every kernel queued before it, so a read inside the step's hot path stalls the queue the
prefetches and reductions rely on. Runtime code therefore never reads a device tensor directly: it
calls ``item`` / ``tolist`` / ``to_host`` / ``wait_event`` with the name of the place it reads from
(``"scaler.found_inf"``), and ``counts()`` says how many each place made. A read of a CPU tensor is
no sync and is not counted. A test asserts the stage-3 hot path makes none per unit; the fake-GPU
world (tests/fakecuda) makes any read that does not come through here raise, since a fake tensor has
no data.

In that world a counted read has no value to return either: it returns ``fake_value`` (what the
caller says stands in for the data, zeros by default), so the runtime runs on to the next check.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

_COUNTS: Counter[str] = Counter()


def counts() -> dict[str, int]:
    """Host syncs made so far, by place."""
    return dict(_COUNTS)


def total() -> int:
    return sum(_COUNTS.values())


def reset() -> None:
    _COUNTS.clear()


def _syncs(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" and t.device.type != "meta"


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - every torch this project supports has it
        return False
    return isinstance(t, FakeTensor)


def note(where: str) -> None:
    """Count one sync made some other way (an event or stream wait) at ``where``."""
    _COUNTS[where] += 1


def to_host(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` on the CPU, counted as a sync at ``where`` when it was on a device."""
    if _syncs(t):
        _COUNTS[where] += 1
    if _is_fake(t):
        return torch.zeros(t.shape, dtype=t.dtype, device="cpu")
    return t.cpu()


def item(t: torch.Tensor, where: str, fake_value: Any = 0) -> Any:
    """``t.item()``, counted as a sync at ``where`` when ``t`` is on a device."""
    if _syncs(t):
        _COUNTS[where] += 1
    if _is_fake(t):
        return fake_value
    return t.item()


def tolist(t: torch.Tensor, where: str, fake_value: Any = None) -> Any:
    """``t.tolist()``, counted as a sync at ``where`` when ``t`` is on a device. A fake tensor gives
    ``fake_value`` (zeros of ``t``'s shape when None)."""
    if _syncs(t):
        _COUNTS[where] += 1
    if _is_fake(t):
        return fake_value if fake_value is not None else _zeros(tuple(t.shape), t.dtype.is_floating_point)
    return t.tolist()


def _zeros(shape: tuple[int, ...], floating: bool) -> Any:
    """Nested lists of zeros, as ``tolist`` of a zero tensor gives, built without a tensor (under a
    fake mode a new tensor is fake too)."""
    if not shape:
        return 0.0 if floating else 0
    return [_zeros(shape[1:], floating) for _ in range(shape[0])]


def wait_event(event: Any, where: str) -> None:
    """Block the host until ``event`` (a ``torch.Event``) completed, counted at ``where``."""
    _COUNTS[where] += 1
    event.synchronize()
