"""The engine's options: every knob of the runtime's schedule and memory, in one typed record.

``zs.shard(...)`` builds an ``EngineOptions`` from its keyword arguments (or takes one whole, as
``options=``); the engine reads its knobs from here and nowhere else. Tools that model the runtime
(the planner, the simulator) import the defaults below instead of restating them.
"""

from __future__ import annotations

import dataclasses

from zeroshard.offload.policy import OffloadPolicy
from zeroshard.sharding.recompute import segment_length

MAX_INFLIGHT_REDUCTIONS = 2
"""Stages 2-3 finish the oldest reduction while more than this many are pending. Two, so that at the
end of backward the last block's reduction is still running when the root's launches, and the
optimizer can step the other units meanwhile (see optim.py). zeroshard.sim and zeroshard.planner read it."""

BACKWARD_PREFETCH_AT = 0.5
"""Fraction of a unit's grads ready before its backward prefetch of earlier units is issued."""

ACCUMULATIONS = ("sharded", "unsharded")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How one sharded model is driven: prefetching, bucketing, accumulation, reduction overlap,
    activation checkpointing and offload. Validated on construction, so a bad value fails before
    the model is touched. See ``zs.shard`` for what each means to a user."""

    prefetch: int = 1
    """Stage 3: units all-gathered ahead of the one computing, in forward and in backward."""
    reshard_after_forward: bool = True
    """Stage 3: free a unit's full params after its forward (and gather them again for backward)."""
    bucket_mb: float = 25.0
    """Stages 0-2: consecutive units merged into reduction buckets of about this many MiB."""
    accumulation: str = "sharded"
    """Inside ``zs.no_sync`` at stages 2-3: reduce every micro-step ("sharded") or keep full grads
    until the synchronising backward ("unsharded")."""
    checkpointing: str = "none"
    """Activation checkpointing policy: "none", "all", "every:K" or "sqrt" (zeroshard/sharding/recompute.py)."""
    offload: OffloadPolicy = dataclasses.field(default_factory=OffloadPolicy)
    """Where fp32 masters and optimizer state live (zeroshard/offload/). "none", "cpu" or None are
    taken as ``OffloadPolicy(kind=...)``, as ``zs.shard(offload=)`` takes them."""
    backward_prefetch_at: float = BACKWARD_PREFETCH_AT
    """Share of a unit's grads complete before its backward prefetch is issued (see ``Engine``)."""
    max_inflight_reductions: int = MAX_INFLIGHT_REDUCTIONS
    """Stages 2-3: the oldest reduction is finished while more than this many are pending."""
    reap_when_done: bool = True
    """Finish a reduction as soon as the backend reports it complete (without a replicate group).
    False finishes one only when the cap or a read forces it: the bound a link slower than compute
    reaches, which is what ``plan --measure`` measures."""
    check_schedule: bool = False
    """Debug mode: compare every optimizer step's collectives with the step schedule the planner
    and simulator read, and raise at the first difference (zeroshard/sharding/schedule_check.py)."""

    def __post_init__(self) -> None:
        if self.offload is None or isinstance(self.offload, str):
            object.__setattr__(self, "offload", OffloadPolicy(kind=self.offload or "none"))
        segment_length(self.checkpointing, 1)  # raises with the valid policies
        if self.accumulation not in ACCUMULATIONS:
            raise ValueError(f"accumulation must be 'sharded' or 'unsharded', got {self.accumulation!r}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 (all-gathers in flight ahead of compute), got {self.prefetch}")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")
        if not 0.0 <= self.backward_prefetch_at <= 1.0:
            raise ValueError(f"backward_prefetch_at is a share of a unit's grads, from 0 to 1; got {self.backward_prefetch_at}")
        if self.max_inflight_reductions < 0:
            raise ValueError(f"max_inflight_reductions must be >= 0, got {self.max_inflight_reductions}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)
