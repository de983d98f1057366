"""The one search the tools choose with: candidates ranked by a cost (communication seconds from
the planner's collectives, a step the simulator replays, or a step measured on ranks), costs within
1% of each other counted equal (unless ``exact``) and settled by the caller's tie-breaks, and the first one that
fits taken. ``plan memory --device-mem`` (planner/recommend.py), ``plan memory --pp --device-mem``
(planner/recommend_pipeline.py) and ``tune`` (tune/choose.py) all rank through it."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence, TypeVar

C = TypeVar("C")


def ranked(cands: Iterable[C], cost: Callable[[C], float], *ties: Callable[[C], Any],
           exact: bool = False) -> list[C]:
    """``cands`` cheapest first: costs within 1% of the cheapest positive one compare equal (a
    model's figures are not finer than that), unless ``exact``; then ``ties`` decide in order."""
    cands = list(cands)
    floor = min((cost(c) for c in cands if cost(c) > 0), default=1.0)

    def key(c: C) -> tuple:
        return (cost(c) if exact else round(cost(c) / floor, 2), *(t(c) for t in ties))

    return sorted(cands, key=key)


def first_fit(cands: Sequence[C], fits: Callable[[C], bool]) -> C | None:
    """The first of ``cands`` (ranked) that fits, or None."""
    return next((c for c in cands if fits(c)), None)
