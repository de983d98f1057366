"""The layouts one plan compares: DDP and ZeRO-1/2/3 over every data-parallel rank, and the hybrid and
offload variants of them when the spec asks."""

from __future__ import annotations

import dataclasses

from zeroshard.runtime.flat import StagePolicy
from zeroshard.tools.planner.spec import STAGE_NAMES, PlanSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
    """One layout to plan: a stage, how many ranks shard each buffer, and where masters and
    optimizer state live (the runtime's offload kind: none, cpu or disk)."""

    name: str
    stage: int
    shards: int
    offload: str = "none"

    @property
    def policy(self) -> StagePolicy:
        return StagePolicy(self.stage)


def variants(spec: PlanSpec) -> list[Variant]:
    """DDP and ZeRO-1/2/3 over every data-parallel rank, plus hybrid and offload variants when asked."""
    out = [Variant(name=STAGE_NAMES[s], stage=s, shards=1 if s == 0 else spec.zero_dp) for s in range(4)]
    if spec.hybrid and spec.shard_size is not None:  # hybrid means a shard size below the world
        out += [Variant(name=f"{STAGE_NAMES[s]}_hybrid", stage=s, shards=spec.shard_size * spec.cp) for s in (1, 2, 3)]
    if spec.offload != "none":  # zs.shard offloads at every stage
        out += [Variant(name=f"{STAGE_NAMES[s]}_offload", stage=s, shards=1 if s == 0 else spec.zero_dp,
                        offload=spec.offload) for s in range(4)]
    return out
