"""The optimizer's memory on the worst rank: its state (elementwise over flat shards, or per tensor on
owner ranks) and the temporaries of each call of the torch class as zs.optimizer steps unit by unit."""

from __future__ import annotations

from zeroshard.runtime.optim import PIPELINE_MIN_NUMEL
from zeroshard.tools.planner.estimate_base import EstimatorBase, element_bytes
from zeroshard.tools.planner.inventory import CommUnit
from zeroshard.tools.planner.owner_state import optimizer_per_rank
from zeroshard.tools.planner.variants import Variant


class OptimizerMemory(EstimatorBase):
    """The estimator's part for the optimizer's state and step scratch."""

    def _optimizer(self, groups, v: Variant) -> int:
        """Optimizer bytes on the worst rank (the buffer tail makes the last ranks lighter)."""
        trainable = [g for g in groups if g.trainable]
        shards = v.shards if v.policy.shard_optimizer else 1
        if self.per_tensor is not None:
            per_element = max((self.costs[g.dtype].per_element for g in trainable), default=0.0)
            return max(optimizer_per_rank(trainable, self.per_tensor, shards, per_element))
        best_rank, best = 0, -1.0
        for rank in range(shards):
            value = sum(self.costs[g.dtype].per_element * g.optimizer_numel(rank) for g in trainable)
            if value > best:
                best_rank, best = rank, value
        return sum(self.costs[g.dtype].bytes_for(g.optimizer_numel(best_rank), g.segments(best_rank))
                   for g in trainable)

    def _unit_scratch(self, units: tuple[CommUnit, ...], v: Variant) -> list[int]:
        """Per unit, the temporaries of its optimizer step on the worst rank.

        zs.optimizer steps one unit at a time, in reduction order: one call of the torch class over
        that unit's segments, one loop per torch param group (decaying or not), whose temporaries
        die with it. Consecutive units share one call until it has PIPELINE_MIN_NUMEL shard
        elements; the call runs once the last of them is reduced, so its scratch is charged at that unit.
        """
        calls, current, numel = [], [], 0
        for i, u in enumerate(units):
            current.append(i)
            numel += sum(g.shard_numel for g in u.groups if g.trainable)
            if numel >= PIPELINE_MIN_NUMEL or i == len(units) - 1:
                calls.append(current)
                current, numel = [], 0
        out = [0] * len(units)
        for call in calls:
            out[call[-1]] = self._call_scratch([units[i] for i in call], v)
        return out

    def _call_scratch(self, units: list[CommUnit], v: Variant) -> int:
        """Temporaries of one call of the torch class over ``units``' segments, on the worst rank.

        A foreach loop (torch's default on CUDA) materialises one temporary per element (the second
        moment's sqrt). The per-tensor loop (the CPU default) makes two per segment (that sqrt, then
        the denominator it is divided into) while the previous segment's denominator is still bound
        to the loop's variable. A fused kernel needs none.
        """
        trainable = [g for u in units for g in u.groups if g.trainable]
        if not trainable:
            return 0
        per_element = max(self.costs[g.dtype].per_element for g in trainable)
        if per_element == 0 or self.spec.optimizer_kwargs.get("fused"):
            return 0  # no state to take a temporary of, or a fused kernel
        elem = max(element_bytes(g.dtype) for g in trainable)
        worst = 0
        for rank in range(v.shards if v.policy.shard_optimizer else 1):
            loops: dict[bool, list[int]] = {}
            for g in trainable:
                for decay, numel in g.segment_numels(rank):
                    loops.setdefault(decay, []).append(numel)
            for seg in loops.values():
                need = sum(seg) if self.foreach else max(p + 2 * c for p, c in zip([0] + seg, seg))
                worst = max(worst, need)
        return worst * elem
