"""Fit the network model's alpha and bandwidth to collectives timed on this machine.

Each size is timed through zeroshard.comm.collectives (so it lands in the ledger like any other
collective), the median of a few repeats after a barrier; then t = steps * alpha + bus_bytes / bw is
fitted by least squares, with steps and bus bytes from the ring formulas in ``network``.
"""

from __future__ import annotations

import statistics
import time

from zeroshard.sim.network import bus_factor

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)
"""Bytes gathered per call: from latency-bound to bandwidth-bound, small enough for a laptop."""


def fit(points: list[tuple[float, float]], op: str, p: int) -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) from (buffer bytes, seconds) pairs of ``op`` on ``p`` ranks."""
    if p < 2 or len(points) < 2:
        raise ValueError("calibration needs at least 2 ranks and 2 message sizes")
    steps = (2 if op == "all_reduce" else 1) * (p - 1)
    xs = [bus_factor(op, p) * n for n, _ in points]
    ts = [t for _, t in points]
    # t = steps*alpha + x*beta: ordinary least squares on (1, x).
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("calibration sizes must differ")
    beta = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx
    alpha = (mt - beta * mx) / steps
    if beta <= 0:
        raise ValueError("timings did not grow with size; rerun with larger sizes or more repeats")
    return max(alpha, 0.0), 1.0 / beta


def time_rank(op: str, sizes: tuple[int, ...], repeats: int) -> list[tuple[float, float]]:
    """Run on every rank of a spawned world; returns (buffer bytes, median seconds) per size."""
    import torch

    import zeroshard as zs
    from zeroshard.comm import collectives

    mesh = zs.init()
    p = mesh.world
    out = []
    for nbytes in sizes:
        numel = max(p, nbytes // 4 // p * p)
        full = torch.zeros(numel)
        shard = torch.ones(numel // p)
        times = []
        for _ in range(repeats + 1):  # the first call pays connection setup
            collectives.barrier(phase="calibrate")
            start = time.perf_counter()
            if op == "all_gather":
                collectives.all_gather(full, shard, phase="calibrate")
            elif op == "reduce_scatter":
                collectives.reduce_scatter(shard, full.clone(), phase="calibrate")
            else:
                collectives.all_reduce(full, phase="calibrate")
            times.append(time.perf_counter() - start)
        out.append((float(numel * 4), statistics.median(times[1:])))
    return out


def calibrate(world: int = 2, op: str = "all_gather", sizes: tuple[int, ...] = DEFAULT_SIZES,
              repeats: int = 5) -> dict:
    from zeroshard.launch import spawn

    points = spawn(time_rank, world, args=(op, sizes, repeats), timeout_s=300)[0]
    alpha, bandwidth = fit(points, op, world)
    return {"op": op, "world": world, "points": points, "alpha_s": alpha, "bandwidth_bytes_per_s": bandwidth}
