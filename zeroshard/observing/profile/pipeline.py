"""The pipeline's part of the step profile: each stage's forward and backward compute, and the bubble.

Under pp the loop's "pipeline" span (zeroshard/trainer/step.py ``pipeline_step``) is the wall time of torch's
schedule on this rank. Inside it, each stage's engine brackets every microbatch's forward, backward
and weight half with ``compute_begin`` / ``compute_end`` events (zeroshard/runtime/events.py); the
rest of the span is idle: waiting for a neighbour's activations or grads (the bubble), plus the
schedule's own bookkeeping. So per step and pp rank:

    step = Σ stages' forward + backward compute + idle + rest (reductions, optimizer, data, ...)

and the measured bubble is idle / schedule time, set against the planner's equal-stage theory
(``PipelineShape.bubble``: (p − 1)/(v·m + p − 1) for the 1F1B family). A stage-3 unit's all-gather
runs inside its forward or backward, so its wait counts as that stage's compute, not as idle.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from zeroshard.runtime import get_engine
from zeroshard.runtime.events import EngineEvent, EventKind, Subscription

COMPUTE_PHASES = ("forward", "backward", "backward_weight")
SPAN = "pipeline"
"""The loop's span around torch's schedule (zeroshard/trainer/step.py)."""


class PipelineClock:
    """Sums, per step, each of this rank's stages' compute time from its engine's events."""

    def __init__(self, pipeline: Any) -> None:
        from zeroshard.parallel.pipeline.shape import PipelineShape  # the planner's bubble, not restated here

        self.stages = list(pipeline.stage_indices)
        self.pp_rank = pipeline.mesh.pp_rank
        self.shape = PipelineShape(pp=pipeline.mesh.pp_size, schedule=pipeline.spec.name,
                                   microbatches=pipeline.microbatches, stages_per_rank=len(self.stages))
        self.theory = self.shape.bubble
        self._compute: dict[tuple[int, str], float] = {}
        self._calls: dict[tuple[int, str], int] = {}
        self._open: dict[int, float] = {}
        self._subs: list[Subscription] = []
        for stage, module in zip(self.stages, pipeline.modules):
            self._subs.append(get_engine(module).events.subscribe(
                functools.partial(self._on_event, stage), kinds=(EventKind.COMPUTE_BEGIN, EventKind.COMPUTE_END)))

    def _on_event(self, stage: int, event: EngineEvent) -> None:
        now = time.perf_counter()
        if event.kind is EventKind.COMPUTE_BEGIN:
            self._open[stage] = now
            return
        began = self._open.pop(stage, None)
        if began is not None:
            key = (stage, event.phase)
            self._compute[key] = self._compute.get(key, 0.0) + (now - began)
            self._calls[key] = self._calls.get(key, 0) + 1

    def close(self) -> None:
        for sub in self._subs:
            sub.remove()
        self._subs = []

    def take(self, spans: list[tuple]) -> dict[str, Any]:
        """This step's pipeline figures (and a fresh count for the next): the schedule's wall time
        from the step's ``spans``, each stage's compute per phase, idle and the measured bubble."""
        compute, self._compute = self._compute, {}
        calls, self._calls = self._calls, {}
        schedule_s = sum(b - a for name, a, b, *_ in spans if name == SPAN)
        by_stage = {str(s): {p: compute.get((s, p), 0.0) for p in COMPUTE_PHASES} for s in self.stages}
        busy = sum(compute.values())
        idle = max(0.0, schedule_s - busy)
        return {"pp_rank": self.pp_rank, "schedule_s": schedule_s, "compute_s": busy, "idle_s": idle,
                "bubble": idle / schedule_s if schedule_s > 0 else None, "stages": by_stage,
                "calls": {str(s): {p: calls.get((s, p), 0) for p in COMPUTE_PHASES} for s in self.stages}}

    def describe(self) -> dict[str, Any]:
        return {"schedule": self.shape.schedule, "pp": self.shape.pp, "microbatches": self.shape.microbatches,
                "stages_per_rank": self.shape.stages_per_rank, "theory_bubble": self.theory}


def mean_of(steps: list[dict]) -> dict[str, Any] | None:
    """The mean of the steps' ``pipeline`` figures (None when the steps have none)."""
    parts = [s["pipeline"] for s in steps if s.get("pipeline")]
    if not parts:
        return None
    n = len(parts)
    stages = {st: {p: sum(x["stages"][st][p] for x in parts) / n for p in COMPUTE_PHASES} for st in parts[0]["stages"]}
    out = {k: sum(x[k] for x in parts) / n for k in ("schedule_s", "compute_s", "idle_s")}
    out["step_s"] = sum(s["step_s"] for s in steps if s.get("pipeline")) / n
    out["bubble"] = out["idle_s"] / out["schedule_s"] if out["schedule_s"] > 0 else None
    return {"pp_rank": parts[0]["pp_rank"], **out, "stages": stages}
