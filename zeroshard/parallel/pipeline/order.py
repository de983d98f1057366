"""The order in which torch's schedule runs each rank's forwards and backwards, without running it.

Every torch schedule builds its per-rank action list (``pipeline_order``: stage, F or B,
microbatch) in its constructor from the stage count, the pp size and the microbatch count alone.
The planner (activations in flight) and the simulator (the pipeline replay) read that list from
the very class the runtime runs (zeroshard/parallel/pipeline/schedules.py), built over placeholder stages
that carry only those counts, so neither restates a schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroshard.parallel.pipeline.schedules import SCHEDULES, ScheduleSpec


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str
    """``F`` (forward of one microbatch through one stage), ``B`` (its full backward), or, in a
    zero-bubble schedule, ``I`` (the backward's input half, whose grads go upstream) and ``W`` (its
    weight half, later)."""
    stage: int
    """The virtual stage (stage ``s`` runs on pp rank ``s % pp``)."""
    microbatch: int


@dataclasses.dataclass
class _Placeholder:
    """What a torch schedule's constructor reads of a stage (its counts), and nothing else."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    stage_index_to_group_rank: dict = dataclasses.field(default_factory=dict)
    submod: Any = None
    """An empty module: the zero-bubble schedules check that no stage's module is compiled."""

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def schedule_order(spec: ScheduleSpec | str, *, pp: int, stages_per_rank: int,
                   microbatches: int) -> dict[int, list[Action]]:
    """pp rank -> its forwards and backwards in torch's order (idle slots and grad reductions left out)."""
    from torch.distributed import pipelining

    spec = SCHEDULES[spec] if isinstance(spec, str) else spec
    cls = getattr(pipelining, spec.torch_class)
    num_stages = pp * stages_per_rank
    from torch import nn

    stages = [_Placeholder(k * pp, num_stages, pp, 0, submod=nn.Module()) for k in range(stages_per_rank)]
    schedule = cls(stages if spec.multi else stages[0], microbatches, loss_fn=lambda out, target: out,
                   scale_grads=False)
    out: dict[int, list[Action]] = {}
    for rank in range(pp):
        actions = []
        seen: dict[tuple[str, int], int] = {}
        for a in schedule.pipeline_order[rank]:
            kind = getattr(a, "computation_type", None) if a is not None else None
            if kind is None or kind.value not in ("F", "B", "I", "W"):
                continue
            mb = a.microbatch_index
            if not spec.multi:
                # A single-stage class runs its own loop, microbatches in increasing order both ways;
                # its action list says in which order F and B alternate, but Schedule1F1B's numbers
                # the last rank's forwards from 1: number them as they come instead.
                mb = seen.get((kind.value, a.stage_index), 0)
                seen[(kind.value, a.stage_index)] = mb + 1
            actions.append(Action(kind.value, a.stage_index, mb))
        out[rank] = actions
    return out


def stage_order(actions: list[Action], stage: int) -> tuple[tuple[str, int], ...]:
    """One virtual stage's (kind, microbatch) actions, in its rank's order: what that stage's engine
    runs in a step (``zeroshard.runtime.schedule.step_schedule``'s ``pipeline_order``). On the first
    stage a zero-bubble schedule's input half computes nothing (no stage upstream needs its input
    grads) and its weight half is one whole, hooked backward: given as that backward ("B")."""
    if stage == 0:
        return tuple(("B" if a.kind == "W" else a.kind, a.microbatch) for a in actions
                     if a.stage == stage and a.kind != "I")
    return tuple((a.kind, a.microbatch) for a in actions if a.stage == stage)


@dataclasses.dataclass(frozen=True)
class InFlight:
    bytes: int
    held: dict[int, int]
    """Microbatches between forward and backward, per stage, at that moment."""


def peak_in_flight(actions: list[Action], weight: dict[int, int]) -> tuple[InFlight, InFlight]:
    """The most ``weight`` bytes held at once before the rank's first backward ends, and after it
    (when the grads of one microbatch are already accumulated). A microbatch is in flight on a
    stage from its forward to its backward (to its weight half in a zero-bubble schedule, which
    reads the saved activations), holding ``weight[stage]``; a backward's moment counts its own
    microbatch, whose activations are alive until it is done."""
    held = dict.fromkeys(weight, 0)
    best = [InFlight(0, dict(held)), InFlight(0, dict(held))]
    after = 0
    for a in actions:
        if a.kind == "F":
            held[a.stage] += 1
        total = sum(weight[s] * n for s, n in held.items())
        if total > best[after].bytes:
            best[after] = InFlight(total, dict(held))
        if a.kind in ("B", "W"):
            held[a.stage] -= 1
            after = 1
    return best[0], best[1]


def bubble_fraction(*, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of each rank's step spent idle with equal stage times: (p − 1) / (v·m + p − 1) for v
    stages per rank (the fill and drain take (p − 1) stage times of one virtual stage, 1/v of a
    rank's work per microbatch); (p − 1) / (m + p − 1) with one stage per rank."""
    v = stages_per_rank
    return (pp - 1) / (v * microbatches + pp - 1)
