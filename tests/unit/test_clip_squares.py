"""Clipping's squared norm, a chunk at a time: the same float64 sum, with a bounded temporary."""

from __future__ import annotations

import torch

from zeroshard.runtime import clip


def test_chunked_square_sum_is_the_float64_sum_of_squares(monkeypatch):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1000, generator=g) * 3
    whole = t.double().square().sum()
    monkeypatch.setattr(clip, "SQUARE_CHUNK", 64)
    for start, stop in ((0, 1000), (10, 999), (500, 501), (7, 7)):
        got = clip.square_sum(t, start, stop)
        want = t[start:stop].double().square().sum()
        assert abs(got.item() - want.item()) <= 1e-12 * max(want.item(), 1.0)
    assert abs(clip.square_sum(t, 0, 1000).item() - whole.item()) <= 1e-12 * whole.item()
    # fp64 grads are squared on a copy: the grad itself is untouched
    d = t.double().clone()
    clip.square_sum(d, 0, 1000)
    assert torch.equal(d, t.double())


def test_ranges_without_holes():
    assert clip.ranges_without([(0, 10)], [(2, 4), (6, 7)]) == [(0, 2), (4, 6), (7, 10)]
    assert clip.ranges_without([(3, 8)], [(2, 4), (6, 7)]) == [(4, 6), (7, 8)]
    assert clip.ranges_without([(0, 5)], []) == [(0, 5)]
    assert clip.ranges_without([(2, 4)], [(0, 10)]) == []


def test_the_temporary_is_one_chunk_in_float64(monkeypatch):
    """Squaring 1M fp32 grads 64K at a time allocates at most one chunk's float64 copy at once."""
    from torch.distributed._tools.mem_tracker import MemTracker

    t = torch.randn(1 << 20)
    monkeypatch.setattr(clip, "SQUARE_CHUNK", 1 << 16)
    tracker = MemTracker()
    tracker.track_external(t)
    with tracker:
        clip.square_sum(t, 0, t.numel())
    peak = max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    assert peak - t.numel() * 4 <= 8 * (1 << 16) + 1024
