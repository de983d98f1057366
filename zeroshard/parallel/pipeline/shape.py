"""A run's pipeline as its config gives it (degree, schedule, microbatches, stages per rank),
resolved and checked, with the bubble an equal-stage pipeline of that shape has in theory."""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroshard.parallel.pipeline.order import bubble_fraction
from zeroshard.parallel.pipeline.schedules import schedule_spec, stages_per_rank


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineShape:
    """The pipeline of a run, as TrainConfig's pp fields give it, resolved and checked."""

    pp: int
    schedule: str
    microbatches: int
    stages_per_rank: int

    @classmethod
    def resolve(cls, *, pp: int, pp_schedule: str = "1f1b", microbatches: int = 0,
                pp_stages_per_rank: int = 0) -> PipelineShape:
        if pp < 2:
            raise ValueError(f"pp={pp}: a pipeline has at least 2 stages; plan without --pp for none")
        spec = schedule_spec(pp_schedule)
        per_rank = stages_per_rank(spec, pp_stages_per_rank)
        return cls(pp=pp, schedule=spec.name, microbatches=microbatches or pp * per_rank, stages_per_rank=per_rank)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stages_of(self, pp_rank: int) -> list[int]:
        """The virtual stages on ``pp_rank`` (torch's looped placement: stage s on rank s % pp)."""
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    @property
    def bubble(self) -> float:
        if schedule_spec(self.schedule).split_backward:
            from zeroshard.parallel.pipeline.replay import equal_time_bubble

            return equal_time_bubble(self.schedule, pp=self.pp, stages_per_rank=self.stages_per_rank,
                                     microbatches=self.microbatches)
        return bubble_fraction(pp=self.pp, microbatches=self.microbatches, stages_per_rank=self.stages_per_rank)

    @property
    def bubble_rule(self) -> str:
        """How ``bubble`` is worked out, for the plan's note."""
        if schedule_spec(self.schedule).split_backward:
            return "replayed from torch's order with equal stages (forward 1, input and weight halves 1 each)"
        return "(p - 1) / (v·m + p - 1)"

    def to_dict(self) -> dict[str, Any]:
        return {"pp": self.pp, "pp_schedule": self.schedule, "microbatches": self.microbatches,
                "pp_stages_per_rank": self.stages_per_rank, "bubble_fraction": self.bubble}
