"""Injected communication faults, for the tests and demos of the watchdog and the doctor.

``ZEROSHARD_COMM_FAULT="kind=K,rank=R,step=S,unit=U[,other=V]"`` arms one fault on rank R during
training step S (1-based), at the module ``U`` (a unit, e.g. ``blocks.2``):

- ``skip-unit``: the parent's loop over its blocks leaves U out on rank R, a rank-dependent branch
  (pytorch#158719, DeepSpeed #7998). At stage 3, U's all-gather is collective, so ranks diverge;
- ``raise``: rank R raises in U's forward pre-hook, just before U's all-gather;
- ``bad-shape``: at U's forward every rank all-reduces a statistics vector whose length differs on
  rank R, the shape of bug a data-dependent size produces;
- ``bad-dtype``: the same, but the vector has the same length and a different dtype on rank R (a
  count built from a Python int on one rank and a float on another). The bytes match, so gloo sums
  garbage without complaint: a silent desync that only ``--desync-check`` catches in flight;
- ``swap-units``: rank R runs U and ``other`` in swapped order; at stage 3 the all-gathers still
  pair (same shapes), so nothing hangs: only the desync check or the doctor can tell.

Nothing here runs unless the variable is set. This is the ``comm.unit`` point of zeroshard/comm/fault_points.py,
which parses and validates the spec.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import zeroshard.comm.fault_points
from zeroshard.comm import collectives

FAULT_ENV = zeroshard.comm.fault_points.env_var("comm.unit")
KINDS = zeroshard.comm.fault_points.COMM_KINDS


def parse(spec: str | None) -> dict | None:
    """The fault spec as a dict (None when unset); parsed and validated by zeroshard.comm.fault_points."""
    fault = zeroshard.comm.fault_points.parse("comm.unit", spec)
    if fault is not None:
        fault.setdefault("other", None)
    return fault


def install(model: nn.Module, rank: int) -> None:
    """Arm the fault from the environment on ``model`` (a no-op when it is unset)."""
    fault = parse(os.environ.get(FAULT_ENV))
    if fault is None:
        return
    target = model.get_submodule(fault["unit"])

    def active() -> bool:
        return collectives.get_ledger().step == fault["step"] and torch.is_grad_enabled()

    kind = fault["kind"]
    if kind == "raise":
        def raise_before(module, args):
            if rank == fault["rank"] and active():
                raise RuntimeError(f"injected fault ({FAULT_ENV}) on rank {rank} at step {fault['step']} "
                                   f"before unit {fault['unit']}")
        target.register_forward_pre_hook(raise_before, prepend=True)
    elif kind in ("bad-shape", "bad-dtype"):
        odd = rank == fault["rank"]
        numel = 16 if odd and kind == "bad-shape" else 8
        dtype = torch.int32 if odd and kind == "bad-dtype" else torch.float32

        def mismatched_stats(module, args):
            if active():
                stats = torch.ones(numel, dtype=dtype, device=args[0].device)
                collectives.all_reduce(stats, unit=fault["unit"], phase="forward")
        target.register_forward_pre_hook(mismatched_stats, prepend=True)
    else:
        _reorder_parent(model, fault, rank, active)


def _reorder_parent(model: nn.Module, fault: dict, rank: int, active) -> None:
    parent_name, _, index = fault["unit"].rpartition(".")
    parent = model.get_submodule(parent_name)
    if not isinstance(parent, nn.ModuleList):
        raise ValueError(f"{FAULT_ENV}: {fault['unit']} must be an item of a ModuleList to skip or swap it")
    first = parent[int(index)]
    second = model.get_submodule(fault["other"]) if fault["other"] else None
    base = type(parent)

    class FaultyList(base):  # type: ignore[misc, valid-type]
        def __iter__(self):
            items = list(base.__iter__(self))
            if rank != fault["rank"] or not active():
                return iter(items)
            if second is None:
                return iter([m for m in items if m is not first])
            i, j = items.index(first), items.index(second)
            items[i], items[j] = items[j], items[i]
            return iter(items)

    parent.__class__ = FaultyList
