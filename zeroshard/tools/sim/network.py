"""Alpha-beta cost of one collective, per algorithm (ring, tree) and link level.

A message of n bytes over a link costs alpha + n * beta (Hockney). For p ranks, Thakur, Rabenseifner
and Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005) give:

- ring all-gather / reduce-scatter: (p-1) alpha + (p-1)/p * n * beta
- ring all-reduce (reduce-scatter then all-gather): 2 (p-1) alpha + 2 (p-1)/p * n * beta
- pairwise all-to-all (expert parallelism's token exchange; n what each rank sends): (p-1) alpha +
  (p-1)/p * n * beta, as the ring all-gather (nccl-tests' alltoall busbw factor is (p-1)/p too)
- tree (recursive doubling / halving): ceil(log2 p) steps of latency instead of p-1, same bandwidth term
  for all-gather and reduce-scatter; NCCL's pipelined double binary tree all-reduce (NCCL 2.4 release
  notes, "Massively Scale Your Deep Learning Training with NCCL 2.4") has 2 log2(p) latency steps and
  moves about 2n per rank, i.e. bandwidth term 2 * n * beta.

Reduction arithmetic (gamma) is ignored: on GPUs it runs at memory speed inside the copy.

n is the full buffer: the all-gather output, the reduce-scatter input, the all-reduce buffer. nccl-tests
(doc/PERFORMANCE.md) defines bus bandwidth so that it is comparable to link speed: for all-reduce
busbw = algbw * 2(n-1)/n, for all-gather and reduce-scatter busbw = algbw * (n-1)/n; ``bus_factor``
is that factor, and the ring costs above are exactly n * bus_factor / link bandwidth plus latency.

Link level: a group inside one node (size <= gpus_per_node, ranks contiguous as zeroshard's mesh lays
them out) runs on NVLink; a group spanning nodes is bounded by the per-GPU network link, and every
ring step waits for its slowest hop, so all of its steps pay the network latency.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from zeroshard.tools.sim.hardware import Hardware
from zeroshard.tools.sim.measured import OPS, pick_link

ALGORITHMS = ("ring", "tree")


def bus_factor(op: str, p: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` on ``p`` ranks."""
    if op not in OPS + ("all_to_all",):
        raise ValueError(f"unknown collective {op!r}; use one of {', '.join(OPS)} or all_to_all")
    if p <= 1:
        return 0.0
    return (2 if op == "all_reduce" else 1) * (p - 1) / p


def link(hw: Hardware, p: int, spans: bool | None = None) -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) for a group of ``p`` ranks; ``spans=None``: contiguous ranks."""
    if not (p > hw.gpus_per_node if spans is None else spans):
        return hw.intra_latency, hw.intra_bandwidth
    return hw.inter_latency, hw.inter_bandwidth


def algorithm_seconds(op: str, algorithm: str, nbytes: float, p: int, hw: Hardware,
                      spans: bool | None = None) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    alpha, bandwidth = link(hw, p, spans)
    if algorithm == "ring":
        steps = (2 if op == "all_reduce" else 1) * (p - 1)
        return steps * alpha + bus_factor(op, p) * nbytes / bandwidth
    if algorithm == "tree":
        depth = math.ceil(math.log2(p))
        if op == "all_reduce":
            return 2 * depth * alpha + 2 * nbytes / bandwidth
        return depth * alpha + bus_factor(op, p) * nbytes / bandwidth
    raise ValueError(f"unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")


def collective_seconds(op: str, nbytes: float, p: int, hw: Hardware, algorithm: str | None = None,
                       spans: bool | None = None, world: int | None = None) -> float:
    """Seconds for one collective; ``algorithm=None`` picks the faster, as NCCL's tuner does.

    NCCL implements all-gather and reduce-scatter with rings only, so the tree is offered only for
    all-reduce unless asked for explicitly. A collective the hardware has a measured fit for
    (``Hardware.links``, inside a node) costs what the fit says: the same ring formula with the
    fitted alpha and bandwidth, which is the form ``sim/calibrate.py`` fits. ``world``: ranks
    running meanwhile (default ``p``), which picks the fit taken under the same load.
    """
    measured = pick_link(hw.links, op, p, world) if algorithm is None and hw.links else None
    if measured is not None and p > 1 and nbytes > 0 and not (p > hw.gpus_per_node if spans is None else spans):
        steps = (2 if op == "all_reduce" else 1) * (p - 1)
        return steps * measured.alpha_s + bus_factor(op, p) * nbytes / measured.bandwidth
    if algorithm is not None:
        return algorithm_seconds(op, algorithm, nbytes, p, hw, spans)
    choices = ALGORITHMS if op == "all_reduce" else ("ring",)
    return min(algorithm_seconds(op, a, nbytes, p, hw, spans) for a in choices)


def wire_bytes(op: str, nbytes: float, p: int) -> float:
    """Bytes each rank sends with a ring: the volume the ZeRO paper counts."""
    return bus_factor(op, p) * nbytes


def rows_seconds(rows: Iterable[Any], hw: Hardware) -> float:
    """Seconds the planner's collective rows (``planner.comm.Collective``: op, size, buffer_bytes,
    count, spans_nodes) take one after another on ``hw``: the simulator's
    alpha-beta cost of each (latency included), so plan's recommender and plan time price alike."""
    return sum(r.count * collective_seconds(r.op, r.buffer_bytes, r.size, hw, spans=r.spans_nodes) for r in rows)
