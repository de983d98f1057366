"""When a pipeline stage's grads are reduced: the run's ``pp_grad_reduce`` as the engine's accumulation.

Every microbatch's backward runs under ``no_sync`` (runtime.py), so the engine's own
``accumulation`` knob decides what stages 2-3 do with it: ``pp_grad_reduce="step"`` maps to
``"unsharded"`` (every microbatch's grads added, unreduced, into the full grad buffer; one
reduction after the schedule), ``"microbatch"`` to ``"sharded"`` (a reduce-scatter after each
microbatch's backward, added into the 1/N grad shard). Stages 0-1 keep full grads all run and
reduce once whatever is asked, so "microbatch" there would change nothing but the user's reading of
it: it is refused. Under the zero-bubble schedule the weight halves' grads, which no hook sees,
are reduced when ``Engine.take_assigned_grads`` takes them. The runtime, the config check and the
pipeline planner all call ``stage_options``, so the three agree. docs/pipeline.md gives the memory
and traffic of each.
"""

from __future__ import annotations

import dataclasses

from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.options import EngineOptions

ACCUMULATION_OF = {"step": "unsharded", "microbatch": "sharded"}
"""The engine's ``accumulation`` for each ``pp_grad_reduce``."""


def check_grad_reduce(pp_grad_reduce: str, *, stage: int | None) -> None:
    """Refuse a per-microbatch reduction at a stage whose engine does not read the choice (``stage``
    None: every stage, as a planner's table, refuses nothing)."""
    if stage is not None and pp_grad_reduce != "step" and not StagePolicy(stage).reads("pp_grad_reduce"):
        raise ValueError(f"pp_grad_reduce={pp_grad_reduce!r} needs stage 2 or 3: stage {stage} keeps full grads all "
                         "run and reduces once per step anyway; pass --stage 2 or 3, or --pp-grad-reduce step")


def stage_options(options: EngineOptions, *, stage: int | None) -> EngineOptions:
    """The options each stage's engine runs with under the pipeline. ``stage`` None (a planner's
    table of every stage): the stages that do not read the choice plan as "step"."""
    check_grad_reduce(options.pp_grad_reduce, stage=stage)
    return dataclasses.replace(options, accumulation=ACCUMULATION_OF[options.pp_grad_reduce])
