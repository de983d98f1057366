"""Deciding the units: which modules are communicated together, and who owns each param.

A unit is a module whose params are gathered and reduced together (a transformer block); the root
unit takes every param no other unit owns (embeddings, final norm, head). A param registered in
more than one place (tied embedding and LM head, or any shared weight) gets exactly one owner, so
it is flattened once, lives in one storage and is reduced once (two copies would drift apart). If its places span
two units it is owned by the root, which stays unsharded for the whole forward and backward, so
every user of the param sees the same storage.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Union, cast

import torch
from torch import nn

UnitsArg = Union[None, Iterable[nn.Module], Callable[[str, nn.Module], bool]]

ROOT = "<root>"

BUCKET_JOIN = "+"
"""Joins the names of the units a stage 0-2 reduction bucket merges, in its order (a checkpoint's
groups record it; ``ckpt reshard`` splits it again)."""


@dataclasses.dataclass
class ParamRef:
    """One distinct param: its canonical name, the original tensor and every place it is registered."""

    fqn: str
    param: nn.Parameter
    places: list[tuple[nn.Module, str]]
    aliases: list[str]
    original_id: int = 0
    """``id()`` of the user's Parameter, so param groups built before sharding can be matched."""

    def __post_init__(self) -> None:
        self.original_id = self.original_id or id(self.param)

    def release(self) -> None:
        """Drop the original values once they live in a flat buffer; keep shape, dtype, grad flag."""
        if not self.param.is_meta:
            self.param = nn.Parameter(torch.empty(self.param.shape, dtype=self.param.dtype, device="meta"),
                                      requires_grad=self.param.requires_grad)


@dataclasses.dataclass
class UnitSpec:
    name: str
    module: nn.Module
    refs: list[ParamRef]

    @property
    def is_root(self) -> bool:
        return self.name == ROOT


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of ModuleLists of identical block types; else large direct children; else none."""
    found: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in claimed or not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1 or not all(any(True for _ in c.parameters()) for c in module):
            continue
        for index, child in enumerate(module):
            found.append((f"{name}.{index}" if name else str(index), child))
            claimed.update(id(m) for m in child.modules())
    if found:
        return found
    total = sum(p.numel() for p in model.parameters())
    large = [(n, c) for n, c in _called_children(model) if sum(p.numel() for p in c.parameters()) * 16 >= total]
    return large if len(large) >= 2 else []


def _called_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's direct children, with a container (a one-block ModuleList, a ModuleDict) replaced by
    its children: a unit's params are gathered by its forward hooks, and a container is never called."""
    children: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            children.extend((f"{name}.{sub}", grandchild) for sub, grandchild in child.named_children())
        else:
            children.append((name, child))
    return children


def _select_units(model: nn.Module, units: UnitsArg) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in model.named_modules()}
    if units is None:
        return find_blocks(model)
    if callable(units) and not isinstance(units, nn.Module):
        chosen: list[tuple[str, nn.Module]] = []
        claimed: set[int] = set()
        for name, module in model.named_modules():
            if name and id(module) not in claimed and units(name, module):
                chosen.append((name, module))
                claimed.update(id(m) for m in module.modules())
        return chosen
    chosen, seen = [], set()
    # What is left is an iterable of modules (an nn.ModuleList is one, though also callable).
    for module in cast(Iterable[nn.Module], units):
        if not isinstance(module, nn.Module):
            raise ValueError(f"units must be modules of the model, got {type(module).__name__}")
        if id(module) in seen:
            shown = names.get(id(module), module.__class__.__name__)
            raise ValueError(f"module {shown!r} is listed twice in units; list each unit once")
        if module is model:
            raise ValueError("the model itself cannot be a unit: the root unit is implicit; list its blocks instead")
        if id(module) not in names:
            raise ValueError(f"unit {module.__class__.__name__} is not a submodule of the model")
        seen.add(id(module))
        chosen.append((names[id(module)], module))
    return chosen


def plan_units(model: nn.Module, units: UnitsArg = None) -> list[UnitSpec]:
    """Block units in module order, then the root unit. Units that own no param are dropped."""
    selected = _select_units(model, units)
    unit_of_module: dict[int, int] = {}
    for index, (name, module) in enumerate(selected):
        for sub in module.modules():
            if id(sub) in unit_of_module:
                other = selected[unit_of_module[id(sub)]][0]
                raise ValueError(f"units {other!r} and {name!r} overlap (one contains the other); units must be disjoint")
            unit_of_module[id(sub)] = index
    root_index = len(selected)

    refs: dict[int, ParamRef] = {}
    owners: dict[int, set[int]] = {}
    for mod_name, module in model.named_modules():
        # Every place a param sits is needed, also a second name for the same (tied) param.
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            ref = refs.get(id(param))
            if ref is None:
                refs[id(param)] = ParamRef(fqn=fqn, param=param, places=[(module, attr)], aliases=[fqn])
            else:
                ref.places.append((module, attr))
                ref.aliases.append(fqn)
            owners.setdefault(id(param), set()).add(unit_of_module.get(id(module), root_index))

    specs = [UnitSpec(name=name, module=module, refs=[]) for name, module in selected]
    specs.append(UnitSpec(name=ROOT, module=model, refs=[]))
    for key, ref in refs.items():
        places = owners[key]
        owner = places.pop() if len(places) == 1 else root_index
        specs[owner].refs.append(ref)
    return [s for s in specs if s.refs or s.is_root]


def validate_params(model: nn.Module) -> torch.device:
    """Refuse models the runtime cannot shard, with the reason and the fix; return their device."""
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        raise ValueError("the model has no trainable params (every param has requires_grad=False); nothing to shard or train")
    devices = {p.device for p in params}
    if len(devices) > 1:
        listing = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"params are on mixed devices ({listing}); move the model to one device before zs.shard")
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise ValueError(f"param {name!r} has dtype {p.dtype}; only floating-point params can be sharded")
    return devices.pop()
