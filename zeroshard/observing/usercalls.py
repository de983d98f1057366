"""Record the torch.distributed collectives that the user's own code makes while `zs.observe` is on.

A logging bug such as ``if rank == 0: dist.all_reduce(loss)`` issues a collective that zeroshard
never sees, so without this the doctor could only say that rank 0 stopped "somewhere else".

torch offers no public hook on c10d calls (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks collectives
against each other, at the price of an extra collective per call, and only from process-group
creation on; NCCL's flight recorder is NCCL-only). So while an observer is active, the collective
functions of the ``torch.distributed`` module (module functions, not a class) are replaced by thin
wrappers, and the originals are put back on exit. A wrapper looks at its caller: calls from
zeroshard or torch itself go straight through; a call from anywhere else is recorded in the ledger
(zeroshard.comm.collectives.external, phase "user") with the file and line that made it.

Limits: code that bound a function before the observer started (``from torch.distributed import
all_reduce``) calls the original and is not recorded; point-to-point send/recv are not collectives
and are left alone.
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from zeroshard.comm import collectives

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "all_to_all", "all_to_all_single",
    "barrier", "gather", "scatter", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list",
)
"""The torch.distributed functions recorded (those that exist in the installed torch)."""

_OURS = ("zeroshard", "torch")
_KEPT = 256


def _is_ours(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in _OURS)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor the ledger sizes the call by: the first tensor argument, else a list's first one."""
    values = [kwargs[k] for k in ("tensor", "output_tensor", "output") if k in kwargs] + list(args)
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    for value in values:
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def _group_name(kwargs: dict) -> str:
    group = kwargs.get("group")
    return "world" if group is None or group is dist.group.WORLD else "user-group"


class UserCollectives:
    """Wraps torch.distributed's collectives while active (a context manager); `calls` maps the
    ledger seq of each recorded call to where the user's code made it."""

    def __init__(self) -> None:
        self.calls: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._originals: dict[str, Callable[..., Any]] = {}
        self._wrappers: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> UserCollectives:
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            self._wrappers[name] = wrapper = self._wrap(name, original)
            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            # Someone else replaced it after us: leave theirs in place rather than undo it.
            if getattr(dist, name, None) is self._wrappers[name]:
                setattr(dist, name, original)
        self._originals.clear()
        self._wrappers.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            frame = inspect.currentframe()
            caller = frame.f_back if frame is not None else None
            del frame
            if caller is None or _is_ours(caller.f_globals.get("__name__", "")):
                return original(*args, **kwargs)
            self._remember(collectives.get_ledger().next_seq, caller)
            del caller
            return collectives.external(name, _first_tensor(args, kwargs), _group_name(kwargs),
                                        lambda: original(*args, **kwargs), async_op=bool(kwargs.get("async_op")))

        return wrapper

    def _remember(self, seq: int, frame: Any) -> None:
        code = frame.f_code
        self.calls[seq] = f"{os.path.relpath(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        while len(self.calls) > _KEPT:
            self.calls.popitem(last=False)

    def header(self) -> dict[str, str]:
        """For the ledger dump: seq (as text, a JSON key) -> where the user's code made that call."""
        return {str(seq): where for seq, where in self.calls.items()}
