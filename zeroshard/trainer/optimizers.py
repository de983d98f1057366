"""Which optimizer a run trains with (the config's ``optimizer``), built sharded or plain.

``adamw`` (the default), ``muon`` (Muon for the hidden matrices, AdamW for the rest:
``zs.muon_groups``), ``adafactor``, or ``module:Class`` for a class of one's own. A TOML table
gives options: ``[optimizer]`` with ``name = "muon"`` and e.g. ``lr = 0.02`` (for muon they go to
the Muon group; the AdamW groups take the run's ``lr`` and ``weight_decay``), or ``per_tensor =
true`` / ``elementwise = true`` to declare a class of one's own. The plain build is the same
optimizer on an unsharded model, the reference ``zeroshard verify`` compares against.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import torch
from torch import nn

from zeroshard.runtime import optim_groups, optimizer as zs_optimizer
from zeroshard.runtime.recipes import muon_groups

NAMED = ("adamw", "muon", "adafactor")
BETAS = (0.9, 0.95)
DECLARATIONS = ("per_tensor", "elementwise")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    name: str
    """adamw, muon, adafactor, or module:Class."""
    options: dict[str, Any]


def parse_optimizer(value: Any) -> OptimizerSpec:
    """``optimizer`` as a flag or TOML key gives it: a name, or a table with ``name`` and options."""
    options: dict[str, Any] = {}
    if isinstance(value, dict):
        options = {k.replace("-", "_"): v for k, v in value.items() if k != "name"}
        value = value.get("name")
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"optimizer={value!r} names no optimizer; use adamw, muon, adafactor or module:Class "
                         "(a TOML [optimizer] table needs name = \"...\" beside its options)")
    name = value.strip()
    if name.lower() in NAMED:
        name = name.lower()
    elif name.count(":") != 1 or not all(name.split(":")):
        raise ValueError(f"optimizer={name!r} is not adamw, muon, adafactor or module:Class (a class of your own, "
                         "e.g. mypkg.optim:Lamb, declared with per_tensor = true or elementwise = true)")
    if name in NAMED and set(options) & set(DECLARATIONS):
        raise ValueError(f"optimizer={name!r} is classified already; per_tensor/elementwise declare a module:Class")
    return OptimizerSpec(name, options)


def resolve_class(name: str) -> type[torch.optim.Optimizer]:
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"optimizer={name!r}: cannot import {module_name!r} ({e}); put it on PYTHONPATH") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"optimizer={name!r}: {module_name} has no torch.optim.Optimizer subclass {class_name!r}")
    return cls


def _takes(cls: type, option: str) -> bool:
    params = inspect.signature(cls).parameters
    return option in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def plan(value: Any, model: nn.Module, *, lr: float, weight_decay: float) -> tuple[type, list[dict] | None, dict]:
    """(the class zs.optimizer is called with, its param_groups or None for the default two, its
    keyword options): one description the sharded and the plain build both follow."""
    spec = parse_optimizer(value)
    if spec.name == "adamw":
        return torch.optim.AdamW, None, {"lr": lr, "weight_decay": weight_decay, "betas": BETAS, **spec.options}
    if spec.name == "muon":
        muon = {"lr": lr, "weight_decay": weight_decay, **spec.options}
        return torch.optim.AdamW, muon_groups(model, muon=muon), {"lr": lr, "weight_decay": weight_decay,
                                                                   "betas": BETAS}
    cls = torch.optim.Adafactor if spec.name == "adafactor" else resolve_class(spec.name)
    options = {"lr": lr, **({"weight_decay": weight_decay} if _takes(cls, "weight_decay") else {}), **spec.options}
    return cls, None, options


def sharded_optimizer(value: Any, model: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """``zs.optimizer`` over a sharded model (one pipeline stage's, under pp)."""
    cls, groups, options = plan(value, model, lr=lr, weight_decay=weight_decay)
    return zs_optimizer(model, cls, param_groups=groups, **options)


def plain_optimizers(value: Any, model: nn.Module, *, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """The same optimizer over an unsharded model: one torch optimizer per class."""
    cls, groups, options = plan(value, model, lr=lr, weight_decay=weight_decay)
    options = {k: v for k, v in options.items() if k not in DECLARATIONS}
    if groups is None:
        wd = options.pop("weight_decay", None)
        return [cls(optim_groups(model, wd if wd is not None else 0.0) if wd is not None else
                    [p for p in model.parameters() if p.requires_grad], **options)]
    params = dict(model.named_parameters())
    by_class: dict[type, list[dict]] = {}
    for group in groups:
        group_cls = group.get("optimizer", cls)
        torch_group = {k: v for k, v in group.items() if k not in ("optimizer", *DECLARATIONS)}
        torch_group["params"] = [params[n] for n in group["params"]]
        by_class.setdefault(group_cls, []).append(torch_group)
    return [c(g, **(options if c is cls else {})) for c, g in by_class.items()]
