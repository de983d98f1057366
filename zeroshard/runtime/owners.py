"""Per-tensor optimizers on sharded masters: each such param has one owner rank, which steps it whole.

A flat shard holds pieces of several params and only part of a large one, so an optimizer that reads
a whole tensor (zeroshard/runtime/optim_kinds.py) cannot step it there. Each such param gets an
owner among the ranks that shard its flat group, balancing elements (the optimizer's work and, for
Muon, Adafactor and LAMB, its state are about linear in them). At the step every rank sends each
owner its pieces of the owner's params, reduced grad and fp32 master (one uneven all-to-all per
flat group); the owner runs the user's own class on the whole tensors and sends every rank the
updated values of its pieces (a second all-to-all). A param that lies wholly inside its owner's
shard moves nothing: the owner steps a view of its shard. State lives only on owners. Replicas
(hybrid sharding) do the same work on the same values, and at stage 0 (one shard) every rank owns
every param, as under torch's DDP, so neither talks to anyone.

Bytes per step, for a param of ``n`` elements whose owner holds ``k`` of them: the other ranks send
``2 (n - k)`` values to the owner and receive ``n - k`` back, in the master dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from zeroshard.comm import collectives
from zeroshard.comm.names import Group, Phase
from zeroshard.runtime.flat import FlatGroup
from zeroshard.runtime.layout import FlatLayout
from zeroshard.runtime.tp import TPSpec, full_value, to_local


@dataclasses.dataclass(eq=False)
class OwnedParam:
    """One param stepped whole: slot ``slot_index`` of ``group``, owned by shard rank ``owner``."""

    group: FlatGroup
    slot_index: int
    owner: int
    torch_group: int
    param: nn.Parameter | None = None
    """The whole tensor (on the owner only) the user's optimizer steps and keys its state by, or,
    for stacked experts, the tensor its ``units`` view."""
    experts: int = 0
    """Stacked expert params (``experts`` on dim 0): each expert's matrix is the optimizer's unit."""
    units: list[nn.Parameter] = dataclasses.field(default_factory=list)
    """With ``experts``: one param per expert, a view of ``param`` while a step runs (on the owner)."""

    @property
    def mine(self) -> bool:
        return self.owner == self.group.shard_rank

    @property
    def numel(self) -> int:
        return self.group.layout.slots[self.slot_index].numel

    @property
    def tp(self) -> TPSpec | None:
        """The param's tensor-parallel split, when its rows or columns are split over the tp ranks."""
        spec = self.group.tp_specs[self.slot_index]
        return spec if spec is not None and spec.shard_dim is not None else None

    @property
    def whole_shape(self) -> torch.Size:
        """What the user's optimizer steps: the param whole, across the tp ranks too."""
        spec = self.tp
        return spec.shape if spec is not None else self.group.layout.slots[self.slot_index].shape

    def local_range(self) -> tuple[int, int] | None:
        """Where the whole param lies in this rank's shard, when it lies there whole."""
        slot, group = self.group.layout.slots[self.slot_index], self.group
        if group.lo <= slot.offset and slot.end <= group.hi:
            return slot.offset - group.lo, slot.end - group.lo
        return None


def assign_owners(items: list[tuple[FlatGroup, int]]) -> list[int]:
    """The owner (a shard rank of the item's group) of each (group, slot index), balancing elements.

    Groups that shard over the same ranks share one balance (``balance_owners``).
    """
    return balance_owners([group.layout.slots[slot].numel for group, slot in items],
                          [((id(group.mesh), group.shards), group.shards) for group, _ in items])


def balance_owners(sizes: list[int], domains: list[tuple[object, int]]) -> list[int]:
    """The owner of each item of ``sizes`` elements among the ``shards`` ranks of its domain
    (``domains[i]`` = (key, shards); items with one key share one balance).

    Largest first onto the least loaded rank (the LPT rule: within 4/3 of the best split); every
    rank computes the same answer from the same layout, so no message is needed. The planner calls
    it on the layout it plans, so its owners are the runtime's.
    """
    owners = [0] * len(sizes)
    members: dict[object, list[int]] = {}
    shards_of: dict[object, int] = {}
    for index, (key, shards) in enumerate(domains):
        members.setdefault(key, []).append(index)
        shards_of[key] = shards
    for key, items in members.items():
        loads = [0] * shards_of[key]
        for i in sorted(items, key=lambda i: (-sizes[i], i)):
            rank = min(range(len(loads)), key=lambda r: (loads[r], r))
            owners[i] = rank
            loads[rank] += sizes[i]
    return owners


class GroupExchange:
    """The owner exchange of one flat group: which of this rank's pieces go to which owner, and back.

    ``send[r]``: (param, start, stop) ranges of this rank's shard holding pieces of params rank ``r``
    owns. ``recv[r]``:
    (param, start, stop) ranges, within the flattened param, that rank ``r``'s shard holds of the
    params this rank owns. Every rank derives both from the layout, so all issue the same collectives.
    """

    def __init__(self, group: FlatGroup, owned: list[OwnedParam]) -> None:
        self.group = group
        self.owned = [o for o in owned if o.mine]
        me, shards = group.shard_rank, group.shards
        self.send: list[list[tuple[OwnedParam, int, int]]] = [[] for _ in range(shards)]
        self.recv: list[list[tuple[OwnedParam, int, int]]] = [[] for _ in range(shards)]
        self.active = False  # whether any piece crosses ranks, on any rank
        for item in sorted(owned, key=lambda o: o.slot_index):
            slot = group.layout.slots[item.slot_index]
            for rank in range(shards):
                lo, hi = group.layout.shard_range(rank)
                a, b = max(slot.offset, lo), min(slot.end, hi)
                if a >= b:
                    continue
                self.active |= rank != item.owner
                if rank == me and item.owner != me:
                    self.send[item.owner].append((item, a - group.lo, b - group.lo))
                if item.owner == me and rank != me:
                    self.recv[rank].append((item, a - slot.offset, b - slot.offset))

    def _exchange(self, chunks: list[list[torch.Tensor]], out_counts: list[int]) -> list[torch.Tensor]:
        """Send ``chunks[r]`` (concatenated) to rank ``r``; return what each rank sent here."""
        group, dtype = self.group, self.group.shard.dtype
        # Offloaded masters are host tensors: gloo exchanges them where they are; a group on an
        # accelerator (NCCL) takes them through its device and back.
        device = group.mesh.device
        in_counts = [sum(c.numel() for c in cs) for cs in chunks]
        flat = [c.to(device) for cs in chunks for c in cs]
        source = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
        out = torch.empty(sum(out_counts), dtype=dtype, device=device)
        collectives.all_to_all(out, source, group=Group.SHARD, unit=group.unit, phase=Phase.OWNER_EXCHANGE,
                               mesh=group.mesh, input_splits=in_counts, output_splits=out_counts)
        return list(out.to(group.shard.device).split(out_counts))

    def gather(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """id(param) -> (whole grad, whole master), flat, for each param this rank owns and holds
        only in part; params wholly inside this rank's shard are stepped in place instead."""
        group = self.group
        master = group.shard
        grad = group.grad_shard
        if grad is None:  # a group no backward reached: its grads are zero, as on the flat path
            grad = torch.zeros_like(master)
        partial = [o for o in self.owned if o.local_range() is None]
        whole = {id(o): (torch.empty(o.numel, dtype=master.dtype, device=master.device),
                         torch.empty(o.numel, dtype=master.dtype, device=master.device)) for o in partial}
        # This rank's own pieces of the params it owns.
        slots = group.layout.slots
        for o in partial:
            slot = slots[o.slot_index]
            a, b = max(slot.offset, group.lo), min(slot.end, group.hi)
            if a < b:
                whole[id(o)][0][a - slot.offset:b - slot.offset].copy_(grad[a - group.lo:b - group.lo])
                whole[id(o)][1][a - slot.offset:b - slot.offset].copy_(master[a - group.lo:b - group.lo])
        if self.active:
            chunks = [[grad[a:b] for _, a, b in ranges] + [master[a:b] for _, a, b in ranges] for ranges in self.send]
            counts = [2 * sum(b - a for _, a, b in pieces) for pieces in self.recv]
            for pieces, received in zip(self.recv, self._exchange(chunks, counts)):
                half = received.numel() // 2
                grads, masters = received[:half], received[half:]
                at = 0
                for item, a, b in pieces:
                    whole[id(item)][0][a:b].copy_(grads[at:at + b - a])
                    whole[id(item)][1][a:b].copy_(masters[at:at + b - a])
                    at += b - a
        return whole

    def scatter(self, updated: Callable[[OwnedParam], torch.Tensor]) -> None:
        """Write the updated values (``updated(param)``: flat, on its owner) into every rank's shard."""
        group, master, slots = self.group, self.group.shard, self.group.layout.slots
        with torch.no_grad():
            for o in self.owned:
                if o.local_range() is None:
                    slot = slots[o.slot_index]
                    a, b = max(slot.offset, group.lo), min(slot.end, group.hi)
                    if a < b:
                        master[a - group.lo:b - group.lo].copy_(updated(o)[a - slot.offset:b - slot.offset])
            if not self.active:
                return
            chunks = [[updated(item)[a:b] for item, a, b in pieces] for pieces in self.recv]
            counts = [sum(b - a for _, a, b in ranges) for ranges in self.send]
            for ranges, received in zip(self.send, self._exchange(chunks, counts)):
                at = 0
                for _, a, b in ranges:
                    master[a:b].copy_(received[at:at + b - a])
                    at += b - a


def held_range(item: OwnedParam) -> tuple[int, int]:
    """The part of ``item`` this rank's shard holds, as elements [start, stop) of the flattened param
    (empty when it holds none)."""
    group, slot = item.group, item.group.layout.slots[item.slot_index]
    a, b = max(slot.offset, group.lo), min(slot.end, group.hi)
    return (a - slot.offset, b - slot.offset) if a < b else (0, 0)


def to_holders(exchange: GroupExchange, whole: dict[int, list[torch.Tensor]],
               count: Callable[[OwnedParam], int]) -> dict[int, list[torch.Tensor]]:
    """Cut each owned param's ``count(param)`` flat tensors (``whole``, on the owner) into the pieces
    each rank's shard holds: id(param) -> this rank's pieces (a checkpoint's owner state, saved by
    whichever rank writes those elements). ``count`` must give every rank the same numbers."""
    mine: dict[int, list[torch.Tensor]] = {}
    for item in exchange.owned:
        a, b = held_range(item)
        if a < b:
            mine[id(item)] = [t[a:b].clone() for t in whole[id(item)]]
    if exchange.active:
        chunks = [[t[a:b] for item, a, b in pieces for t in whole[id(item)]] for pieces in exchange.recv]
        counts = [sum(count(item) * (b - a) for item, a, b in ranges) for ranges in exchange.send]
        for ranges, received in zip(exchange.send, exchange._exchange(chunks, counts)):  # noqa: SLF001 (same room)
            at = 0
            for item, a, b in ranges:
                mine[id(item)] = [received[at + j * (b - a):at + (j + 1) * (b - a)].clone() for j in range(count(item))]
                at += count(item) * (b - a)
    return mine


def to_owners(exchange: GroupExchange, pieces: dict[int, list[torch.Tensor]],
              count: Callable[[OwnedParam], int]) -> dict[int, list[torch.Tensor]]:
    """The inverse of ``to_holders``: every rank's pieces of each param joined whole on its owner."""
    dtype, device = exchange.group.shard.dtype, exchange.group.shard.device
    whole = {id(o): [torch.zeros(o.numel, dtype=dtype, device=device) for _ in range(count(o))] for o in exchange.owned}
    for item in exchange.owned:
        a, b = held_range(item)
        if a < b:
            for target, piece in zip(whole[id(item)], pieces[id(item)]):
                target[a:b].copy_(piece)
    if exchange.active:
        chunks = [[t for item, _, _ in ranges for t in pieces[id(item)]] for ranges in exchange.send]
        counts = [sum(count(item) * (b - a) for item, a, b in recv) for recv in exchange.recv]
        for recv, received in zip(exchange.recv, exchange._exchange(chunks, counts)):  # noqa: SLF001 (same room)
            at = 0
            for item, a, b in recv:
                for target in whole[id(item)]:
                    target[a:b].copy_(received[at:at + b - a])
                    at += b - a
    return whole


def exchange_bytes(owned: list[OwnedParam], rank: int) -> int:
    """Bytes shard rank ``rank`` of the owned params' groups puts into the owner exchange per step
    (what the ledger records under ``owner_exchange``)."""
    return sum(slot_exchange_bytes(item.group.layout, item.slot_index, item.owner, rank,
                                   item.group.shard.element_size()) for item in owned)


def slot_exchange_bytes(layout: FlatLayout, slot_index: int, owner: int, rank: int, element_size: int) -> int:
    """Bytes ``rank`` puts into the owner exchange per step for one param owned by ``owner``: twice
    the elements it holds of it when another rank owns it (grad and master, to the owner), or, on
    the owner, the elements the others hold (the updated values, back)."""
    slot = layout.slots[slot_index]
    total = 0
    for holder in range(layout.shards):
        lo, hi = layout.shard_range(holder)
        n = max(0, min(slot.end, hi) - max(slot.offset, lo))
        if holder != owner and holder == rank:
            total += 2 * n * element_size
        if owner == rank and holder != rank:
            total += n * element_size
    return total


def _whole_values(item: OwnedParam) -> torch.Tensor:
    """The owner's updated values of the param's slot, flat (its tp rank's part of a tp-split one)."""
    assert item.param is not None, "only an owner's params are scattered"
    return tp_part(item.param.detach(), item).reshape(-1)


def tp_whole(part: torch.Tensor, item: OwnedParam) -> torch.Tensor:
    """``part`` (this tp rank's, of the slot's shape) joined whole across the tp ranks, in the
    model's own layout: a collective over "tp" among the param's owners (one per tp rank: owners
    are placed alike on every tp rank, whose layouts are alike). Identity without tp."""
    spec = item.tp
    if spec is None:
        return part
    # An offloaded master is on the host; the tp group's collective runs on its mesh's device.
    whole = full_value(part.to(item.group.mesh.device), spec, unit=item.group.unit, phase=Phase.OWNER_EXCHANGE,
                       mesh=item.group.mesh)
    return whole.to(part.device)


def tp_part(whole: torch.Tensor, item: OwnedParam) -> torch.Tensor:
    """This tp rank's part of a tensor of the param's whole shape (``tp_whole``'s inverse)."""
    spec = item.tp
    if spec is None:
        return whole
    return to_local(whole, spec.describe(), spec.mesh.get_local_rank()).contiguous()


class PerTensorStep:
    """The owner side of a step: each owned param whole in its ``param`` while the user's classes step."""

    def __init__(self, owned: list[OwnedParam]) -> None:
        self.owned = owned
        by_group: dict[int, tuple[FlatGroup, list[OwnedParam]]] = {}
        for item in owned:
            by_group.setdefault(id(item.group), (item.group, []))[1].append(item)
        self.exchanges = [GroupExchange(group, items) for group, items in by_group.values()]
        for item in owned:
            if item.mine:
                shard = item.group.shard
                # Built at its real shape (Muon checks its params are matrices), emptied between steps.
                item.param = nn.Parameter(torch.empty(item.whole_shape, dtype=shard.dtype, device=shard.device))
                # One param per expert: the class steps (and keeps state for) each expert's matrix on
                # its own, as it would the separate matrices of one process's experts. The user's
                # class updates them in place, so the stacked ``param`` they view holds the result.
                item.units = [nn.Parameter(torch.empty(item.whole_shape[1:], dtype=shard.dtype, device=shard.device))
                              for _ in range(item.experts)]
        self.release()


    def mine(self) -> list[OwnedParam]:
        return [o for o in self.owned if o.mine]

    def load_whole(self) -> None:
        """Every owned param's whole master and reduced grad, in its ``param`` and ``param.grad``."""
        for exchange in self.exchanges:
            gathered = exchange.gather()
            group = exchange.group
            for item in exchange.owned:
                assert item.param is not None, "an owned param has its whole tensor"
                shape = group.layout.slots[item.slot_index].shape
                where = item.local_range()
                if where is None:
                    grad, value = gathered[id(item)]
                else:  # wholly in this rank's shard: step a view, nothing to copy back
                    value = group.shard[where[0]:where[1]]
                    shard_grad = group.grad_shard
                    grad = torch.zeros_like(value) if shard_grad is None else shard_grad[where[0]:where[1]]
                if item.tp is not None:  # whole across the tp ranks: every tp rank's owner joins the same matrix
                    value, grad = (tp_whole(t.view(shape), item) for t in (value, grad))
                item.param.data = value.view(item.whole_shape)
                item.param.grad = grad.view(item.whole_shape)
                for e, unit in enumerate(item.units):
                    unit.data, unit.grad = item.param.data[e], item.param.grad[e]

    def store_whole(self) -> None:
        """Send the updated values back into every rank's shard, then drop the whole tensors. A
        tp-split param stepped on a view of its shard was stepped whole across tp instead: its
        tp rank's part goes back into the view."""
        for exchange in self.exchanges:
            with torch.no_grad():
                for item in exchange.owned:
                    where = item.local_range()
                    if item.tp is not None and where is not None:
                        exchange.group.shard[where[0]:where[1]].copy_(_whole_values(item))
            exchange.scatter(_whole_values)
        self.release()

    def release(self) -> None:
        for item in self.mine():
            assert item.param is not None
            for param in [item.param, *item.units]:
                param.grad = None
                # Empty but of the same rank: a class may check a param's ndim (Muon wants matrices).
                param.data = param.data.new_empty([0] * param.dim())
