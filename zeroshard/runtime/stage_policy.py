"""What each ZeRO stage shards: one table the engine, its flat groups and the tools all ask, so no
part of the product restates a stage rule as a branch of its own."""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class StagePolicy:
    """What a ZeRO stage shards. The four stages are this table, not four code paths."""

    stage: int

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {self.stage!r}")

    @functools.cached_property  # read per param and step: a dict hit after the first
    def shard_optimizer(self) -> bool:
        return self.stage >= 1

    @functools.cached_property
    def transient_grads(self) -> bool:
        """Full grads exist only until their reduce-scatter completes (stages 2 and 3)."""
        return self.stage >= 2

    @functools.cached_property
    def shard_params(self) -> bool:
        return self.stage == 3

    @functools.cached_property
    def gathers_after_step(self) -> bool:
        """The updated shards are all-gathered into the full params after the optimizer step
        (stages 1-2; stage 0 steps the full params, stage 3 gathers at the next forward)."""
        return self.shard_optimizer and not self.shard_params

    def reads(self, knob: str) -> bool:
        """Whether the engine reads ``knob`` (a name in ``EngineOptions``' flat knob table) at this
        stage. The gather schedule's knobs (prefetch window, resharding, backward prefetch point)
        exist only where params are sharded; reduction buckets only where they are not (stage 3's
        units are its modules); the in-flight cap and the accumulation choice only where full
        grads are transient. Tools ask this instead of restating it, so a tuner never tries two
        candidates that differ in a knob the run ignores."""
        if knob in _SHARDED_PARAM_KNOBS:
            return self.shard_params
        if knob in _UNSHARDED_PARAM_KNOBS:
            return not self.shard_params
        if knob in _TRANSIENT_GRAD_KNOBS:
            return self.transient_grads
        return True


_SHARDED_PARAM_KNOBS = frozenset({"prefetch", "reshard_after_forward", "backward_prefetch_at"})
_UNSHARDED_PARAM_KNOBS = frozenset({"bucket_mb"})
_TRANSIENT_GRAD_KNOBS = frozenset({"max_inflight_reductions", "accumulation", "pp_grad_reduce"})
