"""Optimizer state per rank when some params step whole on an owner rank (zeroshard/runtime/owners.py).

A per-tensor optimizer (Muon, Adafactor, a LAMB of one's own) keeps its state only on each param's
owner, so a rank's state is what its owned params need, not 1/N of everything: the planner places
the owners with the runtime's own rule (``balance_owners``, on the flat layouts it plans) and sizes
each owned param's state by stepping the class once on a tensor of that param's shape. The rest of
the params (the Muon recipe's embeddings, head, norms and biases) keep the elementwise class's state
on their shard pieces, as without owners. The owner exchange's bytes per rank and step come from
the runtime's ``slot_exchange_bytes`` on the same layouts, so the plan and the ledger agree.
"""

from __future__ import annotations

import dataclasses
import contextlib
import functools
from typing import Any

import torch
from torch import nn

from zeroshard.runtime.optim_kinds import PER_TENSOR_OPTIMIZERS
from zeroshard.runtime.owners import balance_owners, slot_exchange_bytes
from zeroshard.tools.planner.comm import Collective
from zeroshard.tools.planner.inventory import GroupShape

# Stepping a real tensor to read its state is capped at this many elements; a larger param is
# probed at a shape cut to fit and its state scaled by the element ratio (exact for state that is
# linear in the elements, such as Muon's momentum; an over-estimate for factored state).
_REAL_PROBE_NUMEL = 1 << 22


@dataclasses.dataclass(frozen=True)
class PerTensorParams:
    """Which trainable params step whole on an owner, and with which class (by fqn)."""

    classes: dict[str, type]
    kwargs: dict[str, Any]
    elementwise: type
    """The class the other params step with, on their shard pieces."""
    recipe: str
    """How they were chosen, for the plan's note: "muon recipe" or the class's name."""


def per_tensor_params(model: nn.Module, optimizer: type, kwargs: dict[str, Any]) -> PerTensorParams | None:
    """Muon plans as ``zeroshard train --optimizer muon`` runs it (``zs.muon_groups``: the hidden
    matrices on Muon, the rest on AdamW); any other per-tensor class steps every trainable param."""
    if optimizer not in PER_TENSOR_OPTIMIZERS:
        return None
    if optimizer is torch.optim.Muon:
        from zeroshard.runtime.recipes import muon_groups

        muon = next(g for g in muon_groups(model) if g.get("optimizer") is torch.optim.Muon)
        return PerTensorParams({fqn: torch.optim.Muon for fqn in muon["params"]}, kwargs, torch.optim.AdamW,
                               "muon recipe")
    classes = {n: optimizer for n, p in model.named_parameters() if p.requires_grad}
    return PerTensorParams(classes, kwargs, optimizer, optimizer.__name__)


def _step_state(optim_cls: type, shape: tuple[int, ...], dtype: torch.dtype, kwargs: tuple, device: str) -> int:
    param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
    param.grad = torch.ones(shape, dtype=dtype, device=device)
    optimizer = optim_cls([param], **{"lr": 1e-3, **dict(kwargs)})
    optimizer.step()
    return sum(v.numel() * v.element_size() for v in optimizer.state[param].values() if isinstance(v, torch.Tensor))


@functools.lru_cache(maxsize=None)
def _state_cached(optim_cls: type, shape: tuple[int, ...], dtype: torch.dtype, kwargs: tuple) -> int:
    # Shapes only: a class whose step needs no values (Muon) is sized on meta, allocating nothing. One
    # that reads a value (Adafactor's .item()) raises there, and is sized by a real step below.
    with contextlib.suppress(RuntimeError, NotImplementedError):
        return _step_state(optim_cls, shape, dtype, kwargs, "meta")
    numel = int(torch.Size(shape).numel())
    if numel <= _REAL_PROBE_NUMEL:
        return _step_state(optim_cls, shape, dtype, kwargs, "cpu")
    scale = (_REAL_PROBE_NUMEL / numel) ** (1 / len(shape))
    cut = tuple(max(1, int(d * scale)) for d in shape)
    return int(_step_state(optim_cls, cut, dtype, kwargs, "cpu") * numel / torch.Size(cut).numel())


def state_bytes(optim_cls: type, shape: torch.Size, dtype: torch.dtype, kwargs: dict[str, Any]) -> int:
    """Bytes of ``optim_cls``'s state for one whole param of ``shape`` and master ``dtype``."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
    return _state_cached(optim_cls, tuple(shape), dtype, frozen)


@dataclasses.dataclass(frozen=True)
class OwnerLoads:
    """Per shard rank: the owned params' state, their elements inside that rank's shard (which the
    elementwise class does not step), and the bytes it puts into the owner exchange per step."""

    state: tuple[int, ...]
    owned_in_shard: tuple[int, ...]
    exchange: tuple[int, ...]


def owner_loads(groups: list[GroupShape], params: PerTensorParams, shards: int,
                master: dict[torch.dtype, torch.dtype]) -> OwnerLoads:
    """``master`` maps each group's param dtype to its master's (the state's and the exchange's dtype)."""
    """Owners placed by the runtime's rule over ``groups`` (trainable, laid out over ``shards``)."""
    items = [(g, i) for g in groups for i, s in enumerate(g.layout.slots) if s.fqn in params.classes]
    owners = balance_owners([g.layout.slots[i].numel for g, i in items],
                            [((g.ep, g.layout.shards), g.layout.shards) for g, _ in items])
    state, inside, exchange = [0] * shards, [0] * shards, [0] * shards
    for (g, i), owner in zip(items, owners):
        slot, m = g.layout.slots[i], master[g.dtype]
        size = torch.empty(0, dtype=m).element_size()
        whole = state_bytes(params.classes[slot.fqn], slot.shape, m, params.kwargs)
        for rank in range(shards):
            shard = g.shard_of(rank)  # an expert group's shard index is its expert-data-parallel rank
            lo, hi = g.layout.shard_range(shard)
            inside[rank] += max(0, min(slot.end, hi) - max(slot.offset, lo))
            exchange[rank] += slot_exchange_bytes(g.layout, i, owner, shard, size)
            if shard == owner:
                state[rank] += whole
    return OwnerLoads(tuple(state), tuple(inside), tuple(exchange))


def optimizer_per_rank(trainable: list[GroupShape], params: PerTensorParams, shards: int,
                       per_element: float) -> list[int]:
    """Each shard rank's optimizer bytes: its owned params' state, plus the elementwise class's
    (``per_element`` bytes per element) on the rest of its shard. The elementwise class's
    per-segment counters (AdamW's ``step``: a few bytes each) are left out."""
    loads = owner_loads(trainable, params, shards, {g.dtype: g.dtype for g in trainable})
    return [loads.state[r] + int(round(per_element * (sum(g.optimizer_numel(r) for g in trainable)
                                                      - loads.owned_in_shard[r])))
            for r in range(shards)]


def exchange_collective(trainable: list[GroupShape], params: PerTensorParams, shards: int,
                        master: dict[torch.dtype, torch.dtype]) -> Collective:
    """The owner exchange (grad and master to the owner, updated values back) as one all-to-all per
    step over the shard ranks, sized so its wire bytes are the busiest rank's."""
    busiest = max(owner_loads(trainable, params, shards, master).exchange)
    return Collective(op="all_to_all", group="shard", size=shards, phase="owner_exchange",
                      buffer_bytes=busiest * shards // (shards - 1))
