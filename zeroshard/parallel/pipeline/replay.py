"""A schedule's order walked in time: when each pp rank's actions start and end, given each stage's
seconds per action. The profiler's theoretical bubble (equal stages) and the simulator's pipeline
replay (modelled stage times) are the same walk, so it lives here beside the order it walks.
"""

from __future__ import annotations

import dataclasses

from zeroshard.parallel.pipeline.order import schedule_order


def replay_order(order: dict[int, list], times: StageTimes, p2p: float, cores: float | None = None,
            tails: dict[int, float] | None = None,
            finished: dict[int, float] | None = None) -> dict[int, tuple[float, float]]:
    """pp rank -> (end of its last action, seconds its actions ran), walking every rank's actions in
    order and starting each as soon as its rank is free and its input has arrived.

    ``cores``: the ranks share that many processors (a CPU host with more ranks than cores): while
    k > cores actions run, each advances at cores / k of its own speed. None: one device per rank.
    ``tails``: after its last action each rank runs this many seconds of its own (the step's
    reduction and update), sharing the cores like an action; ``finished`` gets when each ends."""
    walk = _OrderWalk(order, times, p2p, tails)
    now = 0.0
    while walk.pending() or walk.running:
        walk.start_ready(now)
        # Oversubscribed cores slow every running action alike.
        rate = 1.0 if cores is None or len(walk.running) <= cores else cores / len(walk.running)
        t = walk.next_event(now, rate)
        walk.advance(now, t, rate, finished)
        now = t
    return {r: (walk.ends[r], walk.busy[r]) for r in order}


class _OrderWalk:
    """``replay_order``'s state: per rank, its next action, what it runs now, and when each action
    (kind, stage, microbatch) finished, which the actions depending on it wait for."""

    def __init__(self, order: dict[int, list], times: StageTimes, p2p: float, tails: dict[int, float] | None) -> None:
        self.order, self.times, self.p2p, self.tails = order, times, p2p, tails
        self.last = len(times.fwd) - 1
        # A zero-bubble order's grads flow upstream from the input half of a split backward.
        self.upstream = "I" if any(a.kind == "I" for actions in order.values() for a in actions) else "B"
        self.done: dict[tuple[str, int, int], float] = {}
        self.busy = dict.fromkeys(order, 0.0)
        self.nxt = dict.fromkeys(order, 0)
        self.free_at = dict.fromkeys(order, 0.0)  # when the rank finished its previous action
        self.ends = dict.fromkeys(order, 0.0)  # when the rank finished its last action
        self.running: dict[int, list[float]] = {}  # rank -> [work left (own seconds), started at]
        self.steps = {r: len(order[r]) + (1 if tails is not None else 0) for r in order}  # the tail: one more

    def pending(self) -> bool:
        return any(self.nxt[r] < self.steps[r] for r in self.order)

    def ready_at(self, r: int) -> float | None:
        """When rank r's next action may start (None: its input is not computed yet)."""
        free_at = self.free_at
        if self.nxt[r] == len(self.order[r]):  # the tail: once the rank is done with its schedule
            return free_at[r]
        a = self.order[r][self.nxt[r]]
        if a.kind == "F":
            dep = None if a.stage == 0 else ("F", a.stage - 1, a.microbatch)
        elif a.kind == "W":  # the weight half follows its own input half
            dep = ("I", a.stage, a.microbatch)
        else:  # B or I: the grad of the stage's output, from the next stage's B or I
            dep = ("F", a.stage, a.microbatch) if a.stage == self.last else (self.upstream, a.stage + 1, a.microbatch)
        if dep is None:
            return free_at[r]
        if dep not in self.done:
            return None
        return max(free_at[r], self.done[dep] + (self.p2p if dep[1] != a.stage else 0.0))

    def start_ready(self, now: float) -> None:
        """Start every idle rank's next action (or tail) whose input has arrived by ``now``."""
        order, nxt, tails = self.order, self.nxt, self.tails
        for r in order:
            if r not in self.running and nxt[r] < self.steps[r]:
                at = self.ready_at(r)
                if at is not None and at <= now:
                    work = tails[r] if nxt[r] == len(order[r]) and tails is not None else \
                        self.times.seconds(order[r][nxt[r]])
                    self.running[r] = [work, now]

    def next_event(self, now: float, rate: float) -> float:
        """The next moment something changes: a running action ends or an idle rank's input arrives."""
        waits = [at for r in self.order if r not in self.running and self.nxt[r] < self.steps[r]
                 for at in [self.ready_at(r)] if at is not None and at > now]
        finish = min((left / rate for left, _ in self.running.values()), default=None)
        candidates = ([now + finish] if finish is not None else []) + waits
        if not candidates:
            raise RuntimeError("pipeline replay stalled: the schedule's order has an action whose input never comes")
        return min(candidates)

    def advance(self, now: float, t: float, rate: float, finished: dict[int, float] | None) -> None:
        """Run every running action from ``now`` to ``t``, and retire those it completes."""
        running, nxt = self.running, self.nxt
        for r in list(running):
            running[r][0] -= (t - now) * rate
            # Relative to t: the subtractions leave rounding crumbs, never an action's real work.
            if running[r][0] <= 1e-12 * max(1.0, t):
                if nxt[r] == len(self.order[r]):  # its tail
                    if finished is not None:
                        finished[r] = t
                else:
                    a = self.order[r][nxt[r]]
                    self.done[(a.kind, a.stage, a.microbatch)] = t
                    self.busy[r] += t - running[r][1]
                    self.ends[r] = t
                self.free_at[r] = t
                nxt[r] += 1
                del running[r]


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Each virtual stage's seconds per microbatch: forward, full backward, and the two halves of a
    split one (zero-bubble schedules)."""

    fwd: list[float]
    bwd: list[float]
    half: list[float]
    """Input or weight half of a stage's split backward: half of its compute (the two matmuls of
    every linear layer)."""
    gathers: dict[tuple[str, int, int], float] = dataclasses.field(default_factory=dict)
    """Seconds an action (kind, stage, microbatch) waits on its ZeRO-3 gathers, on top of its compute."""

    def seconds(self, action) -> float:
        kind, stage = action.kind, action.stage
        if stage == 0 and kind in ("I", "W"):
            # Nothing upstream needs the first stage's input grads: its W is one whole backward.
            return 0.0 if kind == "I" else self.bwd[stage] + self.gathers.get(("B", stage, action.microbatch), 0.0)
        exposed = self.gathers.get((kind, stage, action.microbatch), 0.0)
        return {"F": self.fwd, "B": self.bwd}.get(kind, self.half)[stage] + exposed


def equal_time_bubble(schedule: str, *, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """The mean idle share of torch's order for ``schedule`` with every stage equally fast (forward 1,
    backward 2, each half of a split one 1) and free transfers: the closed form (p − 1)/(v·m + p − 1)
    for the schedules with a full backward; a zero-bubble schedule has none, the replay gives its figure."""
    n = pp * stages_per_rank
    order = schedule_order(schedule, pp=pp, stages_per_rank=stages_per_rank, microbatches=microbatches)
    walked = replay_order(order, StageTimes([1.0] * n, [2.0] * n, [1.0] * n), 0.0)
    span = max(end for end, _ in walked.values())
    return sum(1.0 - busy / span for _, busy in walked.values()) / len(walked)
