"""One ``zs.optimizer`` over several optimizer classes: each *part* steps its own param groups.

The Muon recipe (Muon for the hidden matrices, AdamW for embeddings, head, norms and biases) is
one optimizer to the user: one ``param_groups`` list, one ``step``, one LR scheduler. It is built as
an instance of the call's class (so ``isinstance`` and schedulers work) whose ``param_groups`` hold
every group in the user's order; a group naming another class (``{"optimizer": torch.optim.Muon}``)
is stepped by a private instance of that class, which shares the outer optimizer's ``state`` and
group dicts, so a scheduler's ``lr`` and a checkpoint's state are found where torch keeps them.
Elementwise parts step flat shard segments; per-tensor parts step whole params on their owners
(zeroshard/runtime/owners.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zeroshard.runtime.optim_kinds import OptimKind, classify

GROUP_KEYS = ("optimizer", "elementwise", "per_tensor")
"""Keys of a param group that choose its class and how it runs; never passed to the class."""


def unhooked(step):
    """torch wraps an optimizer class's ``step`` to run step hooks; calling the wrapped one from our
    own (already hooked) step would run every hook twice."""
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


@dataclasses.dataclass
class Part:
    """The torch param groups ``indices`` (of the outer optimizer) stepped by one class one way."""

    cls: type[torch.optim.Optimizer]
    kind: OptimKind
    indices: list[int]
    instance: torch.optim.Optimizer | None = None
    """A private instance of ``cls``; None when ``cls`` is the outer optimizer's own class."""


def group_plans(options: list[dict], optim_cls: type, elementwise: bool, per_tensor: bool) -> list[tuple[type, OptimKind]]:
    """(class, kind) of each param group, taking its GROUP_KEYS out of ``options``; a class the
    group names is declared by the group's own ``elementwise`` / ``per_tensor`` keys."""
    plans = []
    for index, opts in enumerate(options):
        cls = opts.pop("optimizer", optim_cls)
        if isinstance(cls, str) or not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"param group {index} names optimizer {cls!r}; give a torch.optim.Optimizer class, "
                             "e.g. {'params': [...], 'optimizer': torch.optim.Muon}")
        own = cls is optim_cls
        plans.append((cls, classify(cls, elementwise=opts.pop("elementwise", elementwise if own else False),
                                    per_tensor=opts.pop("per_tensor", per_tensor if own else False))))
    return plans


def probe(cls: type, shapes: list[Any], opts: dict, index: int) -> None:
    """Build ``cls`` over meta tensors of the group's whole shapes, on every rank alike, so a class
    that refuses a param (Muon: matrices only) says so on every rank, not only on its owner."""
    try:
        cls([dict(opts, params=[torch.empty(s, device="meta") for s in shapes])])
    except (ValueError, RuntimeError) as error:
        raise ValueError(f"param group {index} ({cls.__name__}) refuses its params: {error}; move those params to "
                         "a group of another optimizer (zs.muon_groups puts matrices in Muon and the rest in AdamW)") \
            from None


def build_parts(opt: torch.optim.Optimizer, torch_groups: list[dict], plans: list[tuple[type, OptimKind]]) -> list[Part]:
    """The parts of ``opt`` (built over its own class's groups); afterwards ``opt.param_groups``
    lists every group in the user's order, each filled in with its own class's defaults."""
    outer = type(opt).__mro__[1]
    parts: dict[tuple[type, OptimKind], Part] = {}
    for index, (cls, kind) in enumerate(plans):
        parts.setdefault((cls, kind), Part(cls, kind, [])).indices.append(index)
    for part in parts.values():
        if part.cls is not outer:
            part.instance = part.cls([torch_groups[i] for i in part.indices])  # type: ignore[call-arg]
    opt.param_groups = list(torch_groups)
    return list(parts.values())


def step_parts(opt: torch.optim.Optimizer, parts: list[Part]) -> None:
    """Step each part on its own groups. The private instances are re-bound every step: loading a
    state dict replaces the outer optimizer's ``state`` and group dicts."""
    groups = opt.param_groups
    try:
        for part in parts:
            runner = opt if part.instance is None else part.instance
            runner.param_groups = [groups[i] for i in part.indices]
            if runner is not opt:
                runner.state = opt.state
            unhooked(part.cls.step)(runner)
    finally:
        opt.param_groups = groups
