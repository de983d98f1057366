"""What the cp exchanges move per layer, from the shapes: the planner's and the simulator's count,
written next to the attention that issues them (the ledger records the same bytes under "cp").

Per layer and micro-step on one rank, ``rows`` sequences of ``seq`` tokens (the whole sequence; a
rank holds ``seq / cp`` of each), widths in elements of ``elem`` bytes:
- ring: forward all-gathers k and v (the ledger counts the gathered output, ``rows·seq·kv_width``
  each), backward's recompute gathers them again, and backward reduce-scatters their gradients (the
  ledger counts the full input, the same size);
- ulysses: q, k, v and the output through an all-to-all each in forward (the ledger counts the
  input, this rank's ``rows·seq/cp`` tokens), and their gradients through one each in backward.
"""

from __future__ import annotations

import dataclasses

import torch

from zeroshard.runtime.schedule_events import ContextExchange, ContextParallelSizes


@dataclasses.dataclass(frozen=True)
class Exchange:
    op: str
    phase: str
    bytes: int
    """One call's buffer, as the ledger records it."""
    count: int
    """Calls per layer and micro-step."""


def exchanges(scheme: str, *, cp: int, rows: int, seq: int, q_width: int, kv_width: int, elem: int) -> list[Exchange]:
    """One layer's cp collectives per micro-step on one rank (none at cp 1)."""
    if cp == 1:
        return []
    if scheme == "ring":
        kv = rows * seq * kv_width * elem
        return [Exchange("all_gather", "forward", kv, 2), Exchange("all_gather", "recompute", kv, 2),
                Exchange("reduce_scatter", "backward", kv, 2)]
    t = seq // cp
    q, kv = rows * t * q_width * elem, rows * t * kv_width * elem
    return [Exchange("all_to_all", "forward", q, 2), Exchange("all_to_all", "forward", kv, 2),
            Exchange("all_to_all", "backward", q, 2), Exchange("all_to_all", "backward", kv, 2)]


def layer_bytes(scheme: str, **shape: int) -> int:
    """One layer's cp bytes per micro-step on one rank."""
    return sum(e.bytes * e.count for e in exchanges(scheme, **shape))


def transient_bytes(scheme: str, *, cp: int, rows: int, seq: int, q_width: int, kv_width: int, elem: int) -> int:
    """What one layer's attention holds while it runs beyond the activations it saves: ring, the
    whole sequence's keys and values (GQA repeated to the query heads) and, in backward, their
    gradients; Ulysses, the head-sharded q, k, v and output (1/cp of the heads, the whole sequence)."""
    if cp == 1:
        return 0
    if scheme == "ring":
        return 2 * 2 * rows * seq * q_width * elem
    return rows * seq * (2 * q_width + 2 * kv_width) * elem // cp


def schedule_sizes(scheme: str, *, blocks: int, dtype: torch.dtype, cp: int, rows: int, seq: int, q_width: int,
                   kv_width: int) -> ContextParallelSizes | None:
    """What the runtime's step schedule lists for the blocks' exchanges (``step_schedule(cp=...)``),
    the one list the planner and the simulator read; None at cp 1."""
    if cp == 1:
        return None
    elem = dtype.itemsize
    found = exchanges(scheme, cp=cp, rows=rows, seq=seq, q_width=q_width, kv_width=kv_width, elem=elem)
    return ContextParallelSizes(exchanges=tuple(ContextExchange(e.op, e.phase, e.bytes // elem, e.count) for e in found),
                                dtype=dtype, blocks=blocks)
