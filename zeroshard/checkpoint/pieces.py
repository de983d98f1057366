"""Where the runtime keeps each element, in the terms a checkpoint stores: pieces of params.

A flat group's buffer holds params at ``[slot.offset, slot.offset + slot.numel)``; a rank owns
``[group.lo, group.hi)``. A *piece* is the part of one param inside some range, expressed as an
element range of the flattened param, so it means the same thing at every world size and stage.
Both save and load go through these helpers, so the two directions cannot disagree.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
from torch import nn

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.comm.expert_mesh import ExpertMesh
from zeroshard.runtime.expert_placement import expert_rows
from zeroshard.runtime.flat import FlatGroup
from zeroshard.runtime.optim import sharded_state
from zeroshard.runtime.layout import ALIGN, FlatLayout, Slot


def split_range(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``parts`` contiguous, ALIGN-rounded parts of ``[lo, hi)`` (the last may be short
    or empty)."""
    chunk = -(-(hi - lo) // (parts * ALIGN)) * ALIGN
    a = min(hi, lo + index * chunk)
    return a, min(hi, a + chunk)


def writer_range(group: FlatGroup, rank: int, world: int) -> tuple[int, int]:
    """The buffer range this rank writes. Each element is written by exactly one rank.

    A rank's shard is held by ``world // shards`` replicas (every rank at stage 0; the replicate
    dimension of a hybrid mesh at stages 1-3). The replicas split it between them, so a stage-0
    save is as parallel as a stage-3 one and nothing is written twice. Rank order matches the mesh:
    ``rank // shards`` is the replica index (rank = replica * shard_size + shard_rank).
    """
    replicas = world // group.shards
    if isinstance(group.mesh, ExpertMesh):
        # Expert params: only the rank's edp group holds its experts' values (the other ep ranks
        # hold other experts), so its replicas are the edp ranks that hold the same shard.
        del rank
        replicas = group.mesh.shard_size // group.shards
        return split_range(group.lo, group.hi, replicas, group.mesh.shard_rank // group.shards)
    if group.mesh.tp_size > 1 or group.mesh.pp_size > 1:
        # Tensor parallel: the ranks with this rank's tp index are the data-parallel ones that hold
        # copies of its values (ranks of one tp group hold different parts; see saved_name). Under
        # pp, only the data-parallel ranks of this rank's stage hold its groups at all.
        del rank
        replicas = group.mesh.dp_size // group.shards
        return split_range(group.lo, group.hi, replicas, group.mesh.dp_rank // group.shards)
    return split_range(group.lo, group.hi, replicas, rank // group.shards)


TP_PART = "#tp"
"""A tensor-parallel param is saved as one manifest param per tp rank, named ``fqn#tp<rank>``."""


def saved_name(group: FlatGroup, index: int) -> str | None:
    """The manifest name this rank saves slot ``index`` under, or None when another tp rank saves it
    (a param every tp rank holds whole is written by tp rank 0 only)."""
    slot, spec = group.layout.slots[index], group.tp_specs[index]
    if spec is not None and spec.shard_dim is not None:
        return f"{slot.fqn}{TP_PART}{group.mesh.tp_rank}"
    return slot.fqn if group.mesh.tp_rank == 0 else None


def saved_extent(group: FlatGroup, index: int) -> tuple[torch.Size, int]:
    """(the shape slot ``index`` is saved under, the element of it where the slot starts). An
    expert param's slot is this rank's block of experts, rows [ep_rank·n, (ep_rank+1)·n) of the
    model's own tensor, which are one contiguous run of it: it is saved as that run of the whole
    tensor, so any ep degree reads its block by element range, as any world size reads its shard.
    Any other slot is saved in its own shape (a tp part's is its part's), from element 0."""
    return expert_rows(group.mesh, group.layout.slots[index].shape)


def owned_slots(layout: FlatLayout, a: int, b: int) -> Iterator[tuple[int, Slot, int, int]]:
    """(slot index, slot, start, stop), in buffer coordinates, for the real elements (no padding)
    inside [a, b)."""
    for index, slot in enumerate(layout.slots):
        start, stop = max(slot.offset, a), min(slot.end, b)
        if start < stop:
            yield index, slot, start, stop


@dataclasses.dataclass(frozen=True)
class Segment:
    """One optimizer param: elements ``[start, stop)`` of ``group.shard``, in torch param group ``index``."""

    param: nn.Parameter
    group: FlatGroup
    start: int
    stop: int
    index: int

    def covers(self, a: int, b: int) -> bool:
        """Whether buffer range [a, b) lies inside this segment."""
        lo = self.group.lo
        return lo + self.start <= a and b <= lo + self.stop


class SegmentIndex:
    """The sharded optimizer's segments, findable by flat group and buffer range."""

    def __init__(self, optimizer) -> None:
        state = sharded_state(optimizer)
        if state is None:
            raise CheckpointError(
                f"the optimizer is a plain {type(optimizer).__name__}; checkpoints need the sharded optimizer "
                "from zs.optimizer(model, cls, ...) (its params are the shard segments the state is kept on)")
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.optimizer = optimizer
        self.by_group: dict[int, list[Segment]] = {}
        self.all: list[Segment] = []
        for param, group, start, stop in state.segments.entries:
            segment = Segment(param, group, start, stop, group_of[id(param)])
            self.by_group.setdefault(id(group), []).append(segment)
            self.all.append(segment)

    def find(self, group: FlatGroup, a: int, b: int) -> Segment:
        for segment in self.by_group.get(id(group), []):
            if segment.covers(a, b):
                return segment
        raise CheckpointError(f"no optimizer segment holds elements [{a}, {b}) of flat group {group.unit!r}; "
                              "was the optimizer built for this model with zs.optimizer?")


def split_state(state: dict, numel: int, where: str) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Split one segment's optimizer state into elementwise tensors (saved as pieces) and scalars
    (saved once per param group, like AdamW's ``step``)."""
    tensors, scalars = {}, {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.numel() != numel:
                raise CheckpointError(
                    f"optimizer state {name!r} of {where} has {value.numel()} elements for a segment of {numel}; "
                    "only elementwise state (one value per param element) or scalars can be checkpointed")
            tensors[name] = value
        else:
            scalars[name] = value
    return tensors, scalars


def ordered_refs(model: nn.Module, groups: list[FlatGroup]) -> list[tuple[FlatGroup, int]]:
    """(group, slot index) for every param, in ``model.named_parameters()`` order, so manifests and
    exports list params the way ``state_dict()`` does."""
    order = {name: i for i, (name, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    found = [(g, i) for g in groups for i in range(len(g.layout.slots))]
    return sorted(found, key=lambda gi: min(order.get(a, len(order)) for a in gi[0].refs[gi[1]].aliases))


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong in a state dict (``register_buffer(..., persistent=False)`` ones do not)."""
    out = []
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
            if name in module._non_persistent_buffers_set:  # noqa: SLF001 (no public API)
                continue
            out.append((f"{module_name}.{name}" if module_name else name, buffer))
    return out
