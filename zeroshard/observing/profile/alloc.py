"""Peak tensor memory of a piece of code, from the allocator's own events."""

from __future__ import annotations

from typing import Any, Callable

from torch.profiler import ProfilerActivity, profile


def peak_allocated(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Run ``fn``; return (peak bytes allocated above the start, its result)."""
    peak, _, result = allocation_profile(fn)
    return peak, result


def allocation_profile(fn: Callable[[], Any]) -> tuple[int, int, Any]:
    """Run ``fn``; return (peak, still-allocated-at-the-end) bytes of tensor storage above the start,
    and its result.

    Works on CPU, where there is no ``max_memory_allocated``. The profiler reports each allocation
    on the innermost op (and again on its callers), so only leaf events are summed.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e for e in prof.events() if e.cpu_memory_usage and (e.name == "[memory]" or not e.cpu_children)),
                    key=lambda e: e.time_range.start)
    current = peak = 0
    for event in events:
        current += event.cpu_memory_usage
        peak = max(peak, current)
    return peak, current, result
