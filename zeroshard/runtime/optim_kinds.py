"""Which way an optimizer class can run on sharded masters: on flat slices, or whole tensors on an owner.

An *elementwise* optimizer updates each element from its own grad and state alone, so it can step
flat shard slices that hold pieces of several params (zeroshard/runtime/optim.py). A *per-tensor*
one reads a whole tensor (Muon's orthogonalisation, Adafactor's row and column means, a LAMB or
LARS trust ratio), so each such param is stepped whole on one owner rank
(zeroshard/runtime/owners.py). A class that reads several tensors at once (LBFGS) fits neither.
"""

from __future__ import annotations

import enum

import torch


class OptimKind(enum.Enum):
    ELEMENTWISE = "elementwise"
    PER_TENSOR = "per_tensor"


# Each element's update reads nothing but its own grad and state (plus per-step scalars such as the
# step count, equal on every segment). Each class was checked to be so, with every option it takes
# (amsgrad, nesterov, centered, ...).
ELEMENTWISE_OPTIMIZERS: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD,
})

# torch classes that read a whole tensor per param but nothing across params: stepped on owners.
PER_TENSOR_OPTIMIZERS: frozenset[type] = frozenset({torch.optim.Muon, torch.optim.Adafactor})

# torch classes known to read other elements, with what they read; opting in cannot make them right.
_NOT_ELEMENTWISE = {
    "LBFGS": "dot products and a line search over all params at once",
    "SparseAdam": "sparse gradients, which the flat reduction never produces",
    "Adafactor": "row and column means of each matrix and each param's RMS",
    "Muon": "an orthogonalisation of each whole matrix",
}
_CROSS_TENSOR = {"LBFGS", "SparseAdam"}


def classify(optim_cls: type, *, elementwise: bool = False, per_tensor: bool = False) -> OptimKind:
    """How ``optim_cls`` steps sharded masters, or a one-line ValueError naming the problem and the fix."""
    name = optim_cls.__name__
    if elementwise and per_tensor:
        raise ValueError(f"{name} is declared both elementwise=True and per_tensor=True; declare one")
    is_torch = optim_cls.__module__.startswith("torch.optim")
    if is_torch and name in _CROSS_TENSOR:
        raise ValueError(f"{name} is not elementwise ({_NOT_ELEMENTWISE[name]}), so it cannot run on flat shards "
                         "nor per tensor on an owner rank; use AdamW, Adam, SGD, Muon, Adafactor or another "
                         "elementwise or per-tensor optimizer")
    if optim_cls in PER_TENSOR_OPTIMIZERS or (is_torch and name in _NOT_ELEMENTWISE):
        if elementwise:
            raise ValueError(f"{name} is not elementwise ({_NOT_ELEMENTWISE[name]}), so it cannot run on flat "
                             "shards; drop elementwise=True and zs.optimizer steps each param whole on one owner rank")
        return OptimKind.PER_TENSOR
    if per_tensor:
        return OptimKind.PER_TENSOR
    if optim_cls in ELEMENTWISE_OPTIMIZERS or elementwise:
        return OptimKind.ELEMENTWISE
    raise ValueError(
        f"{name} is not a known elementwise optimizer: zs.optimizer steps it on flat shard slices that mix "
        "pieces of several params and hold only part of each, so any per-tensor quantity (a norm, a LAMB/LARS "
        "trust ratio, a factored moment, an orthogonalisation) would be computed over the wrong elements; "
        "if every element's update reads only its own grad and state, pass elementwise=True, if it reads one "
        "whole param at a time pass per_tensor=True (each param is then stepped whole on one owner rank); "
        "declaring elementwise=True otherwise would silently give wrong updates")

