"""What the runtime would allocate for a model, read from the model without allocating it.

The planner does not re-derive the runtime's layout: it calls the same functions ``zs.shard`` calls
(``plan_units`` for units and tied-weight ownership, ``reduction_buckets`` for stage 0-2 reduction buckets,
``FlatLayout`` for alignment and padding), on a model whose params may live on the meta device.
So padding, frozen params and tied weights are counted exactly as the runtime lays them out.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroshard.tools.planner.experts import ExpertSplit
from zeroshard.tools.planner.tp import TensorParallel
from zeroshard.runtime.engine import merge_in_order, reduction_buckets
from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.layout import FlatLayout, decay_first, decays
from zeroshard.runtime.wrap import ParamRef, UnitSpec, UnitsArg, plan_units

if TYPE_CHECKING:
    from zeroshard.models.gpt import GPTConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupShape:
    """One flat buffer of the runtime: one (unit or bucket, dtype, trainable) triple."""

    unit: str
    dtype: torch.dtype
    trainable: bool
    layout: FlatLayout
    decay: tuple[bool, ...]
    """Per slot: whether the default optimizer groups decay it (decides segment boundaries)."""
    ep: int = 1
    """An expert group's ep degree (it holds this rank's 1/ep of the experts, sharded over the ranks
    that hold the same ones: the expert mesh); 1 for a dense group."""
    tp: int = 1
    """The dense mesh's tp degree, under which an expert group's ranks are the world's, not dp's."""

    @property
    def expert(self) -> bool:
        return self.ep > 1

    def shard_of(self, rank: int) -> int:
        """The shard of this buffer a data-parallel ``rank`` (its index in the dense shard group)
        holds: the same index for a dense group; for an expert group, its expert-data-parallel index
        (ranks are laid out with ep innermost over the world: zeroshard/comm/expert_mesh.py; under
        tp, that of the data-parallel rank's first tp rank)."""
        return rank * self.tp // self.ep if self.expert else rank

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def span_end(self) -> int:
        """End of the last slot's padded span; past it is buffer-tail padding no optimizer sees."""
        last = self.layout.slots[-1]
        return last.offset + last.span

    def optimizer_numel(self, shard_rank: int) -> int:
        """Elements of this rank's optimizer segments: its shard, less the buffer tail."""
        lo, hi = self.layout.shard_range(self.shard_of(shard_rank))
        return max(0, min(hi, self.span_end) - lo)

    def segments(self, shard_rank: int) -> int:
        """Optimizer params (maximal same-group runs) on this rank, as ``zs.optimizer`` builds them."""
        return len(self.segment_numels(shard_rank))

    def segment_numels(self, shard_rank: int) -> list[tuple[bool, int]]:
        """(decays, elements) of each optimizer param on this rank, in buffer order."""
        return [(flag, stop - start)
                for flag, start, stop in self.layout.segments(self.shard_of(shard_rank), self.decay.__getitem__)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommUnit:
    """What is gathered or reduced together: a block or the root (stage 3), or a bucket (stages 0-2)."""

    name: str
    is_root: bool
    groups: tuple[GroupShape, ...]

    def full_bytes(self, compute: dict[torch.dtype, torch.dtype]) -> int:
        """Bytes of the unit's full params in their compute dtype (what an all-gather materialises)."""
        return sum(g.numel * _size(compute[g.dtype]) for g in self.groups)

    def grad_bytes(self, reduce: dict[torch.dtype, torch.dtype]) -> int:
        """Bytes of the unit's full grad buffers in the reduce dtype (stages 2-3 allocate them in backward)."""
        return sum(g.numel * _size(reduce[g.dtype]) for g in self.groups if g.trainable)


    def shard_grad_bytes(self, reduce: dict[torch.dtype, torch.dtype]) -> int:
        """Bytes of one rank's reduce-scatter output for the unit, in the reduce dtype."""
        return sum(g.shard_numel * _size(reduce[g.dtype]) for g in self.groups if g.trainable)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """Counts read from the model: distinct params (tied counted once), trainable and frozen."""

    name: str
    params: int
    trainable: int
    frozen: int
    tied: int
    """Params registered in more than one place (each counted once above)."""
    dtypes: tuple[tuple[str, int], ...]
    gpt: GPTConfig | None
    """The ``GPTConfig`` when the model is our GPT (activations are then estimated per layer)."""


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype, device="meta").element_size()


def _groups(name: str, refs: list[ParamRef], shards: int, tp: TensorParallel, experts: ExpertSplit,
            expert_shards: int) -> tuple[GroupShape, ...]:
    # Same split as the engine: one buffer per (dtype, trainable, mesh), in first-seen order, of
    # each param's tp-local part (what zs.shard flattens under tensor parallelism), or of an expert
    # param's ep block, sharded over the expert-data-parallel ranks; decaying params first
    # (runtime/grouping.py's split_groups).
    keyed: dict[tuple[torch.dtype, bool, bool], list[ParamRef]] = {}
    for ref in refs:
        keyed.setdefault((ref.param.dtype, ref.param.requires_grad, experts.is_expert(ref.fqn)), []).append(ref)
    out = []
    for (dtype, trainable, expert), group_refs in keyed.items():
        group_refs = decay_first(group_refs, lambda r: (r.fqn, r.param.shape))
        shapes = [(r.fqn, experts.local_shape(r.fqn, tp.local_shape(r.fqn, r.param.shape))) for r in group_refs]
        layout = FlatLayout(shapes, expert_shards if expert else shards)
        out.append(GroupShape(unit=name, dtype=dtype, trainable=trainable, layout=layout,
                              decay=tuple(decays(r.fqn, r.param.shape) for r in group_refs),
                              ep=experts.ep if expert else 1, tp=experts.tp if expert else 1))
    return tuple(out)


class Inventory:
    """The units of one model, and the comm units the runtime builds for each stage and shard count."""

    def __init__(self, model: nn.Module, *, name: str, units: UnitsArg = None, gpt: GPTConfig | None = None,
                 tp: TensorParallel | None = None, experts: ExpertSplit | None = None, dp: int = 1,
                 expert_dp: int | None = None) -> None:
        self.tp = tp or TensorParallel()
        self.experts = experts or ExpertSplit()
        # The ranks that hold the same experts, which shard them wherever the dense params are
        # sharded (with hybrid sharding too: the expert mesh has no replicas): world / ep of them,
        # dp / ep without tp.
        self.expert_dp = expert_dp or max(1, dp // self.experts.ep)
        self.specs: list[UnitSpec] = plan_units(model, units)
        refs = [r for s in self.specs for r in s.refs]
        dtypes: dict[str, int] = {}
        for r in refs:
            key = str(r.param.dtype).removeprefix("torch.")
            dtypes[key] = dtypes.get(key, 0) + r.param.numel()
        trainable = sum(r.param.numel() for r in refs if r.param.requires_grad)
        total = sum(r.param.numel() for r in refs)
        if trainable == 0:
            raise ValueError("the model has no trainable params (every param has requires_grad=False); "
                             "there is nothing to plan a training run for")
        self.facts = ModelFacts(name=name, params=total, trainable=trainable, frozen=total - trainable,
                                tied=sum(1 for r in refs if len(r.places) > 1), dtypes=tuple(sorted(dtypes.items())),
                                gpt=gpt)
        self._cache: dict[tuple, tuple[CommUnit, ...]] = {}

    def local_numel(self, ref: ParamRef) -> int:
        """Elements of this rank's tp part, or ep block, of a param (all of it without either)."""
        return self.experts.local_shape(ref.fqn, self.tp.local_shape(ref.fqn, ref.param.shape)).numel()

    @property
    def dtypes(self) -> set[torch.dtype]:
        return {r.param.dtype for s in self.specs for r in s.refs}

    def comm_units(self, *, stage: int, shards: int, bucket_bytes: int) -> tuple[CommUnit, ...]:
        """The engine's communication units, in its backward (= reduction) order."""
        policy = StagePolicy(stage)
        # What the engine's units depend on: shards only where the optimizer is sharded, buckets
        # only where params stay whole.
        key = (stage, shards if policy.shard_optimizer else 1, 0 if policy.shard_params else bucket_bytes)
        if key not in self._cache:
            self._cache[key] = self._build(*key)
        return self._cache[key]

    def _build(self, stage: int, shards: int, bucket_bytes: int) -> tuple[CommUnit, ...]:
        # The engine lists blocks in reverse module order, then the root: roughly backward order.
        order = [s for s in reversed(self.specs) if not s.is_root] + [s for s in self.specs if s.is_root]
        expert_shards = self.expert_dp if StagePolicy(stage).shard_optimizer else 1
        if StagePolicy(stage).shard_params:
            return tuple(CommUnit(name=s.name, is_root=s.is_root,
                                  groups=_groups(s.name, s.refs, shards, self.tp, self.experts, expert_shards))
                         for s in order if s.refs)
        out = []
        for bucket in self._buckets(order, bucket_bytes):
            name = "+".join(s.name for s in bucket)
            refs = [r for s in bucket for r in s.refs]
            if refs:
                out.append(CommUnit(name=name, is_root=any(s.is_root for s in bucket),
                                    groups=_groups(name, refs, shards, self.tp, self.experts, expert_shards)))
        return tuple(out)

    def _buckets(self, order: list[UnitSpec], bucket_bytes: int) -> list[list[UnitSpec]]:
        """The engine's stage 0-2 buckets. It sizes them by the params it is given, which under ep
        are each rank's blocks of the experts (zs.expert_parallel ran first): the same rule over
        those sizes."""
        if self.experts.ep == 1:
            return reduction_buckets(order, bucket_bytes)
        return merge_in_order(order, lambda spec: sum(self.experts.local_shape(r.fqn, r.param.shape).numel()
                                                      * r.param.element_size() for r in spec.refs), bucket_bytes)


def meta_gpt(config) -> nn.Module:
    """Our GPT built on the meta device: shapes and dtypes only, no memory."""
    from zeroshard.models import GPT

    with torch.device("meta"):
        return GPT(config)
