"""Context parallelism in a plan: each rank's activations are those of its ``seq / cp`` tokens, one
layer's attention at a time holds the exchange's buffers (``transient_bytes``), and every layer's
exchanges are the cp collectives of the step. The byte counts are the attention's own
(zeroshard/parallel/cp/volume.py), so the ledger, the planner and the simulator agree.
"""

from __future__ import annotations

import dataclasses

from zeroshard.parallel.cp.volume import exchanges, transient_bytes
from zeroshard.tools.planner.activations import ActivationEstimate
from zeroshard.tools.planner.comm import Collective


def cp_shape(*, cp: int, rows: int, seq: int, q_width: int, kv_width: int, elem: int) -> dict[str, int]:
    return dict(cp=cp, rows=rows, seq=seq, q_width=q_width, kv_width=kv_width, elem=elem)


def with_exchange(act: ActivationEstimate, scheme: str, shape: dict[str, int]) -> ActivationEstimate:
    """``act`` (already of ``seq / cp`` tokens) with one layer's exchange buffers next to a block's
    backward temporaries, where a layer's attention runs."""
    extra = transient_bytes(scheme, **shape)
    block = act.block + extra
    return dataclasses.replace(act, block=block, workspace=max(act.head, block))


def cp_collectives(scheme: str, shape: dict[str, int], *, layers: int, micro_steps: int,
                   spans_nodes: bool = False) -> tuple[Collective, ...]:
    """The step's cp collectives on one rank: each layer's exchanges, every micro-step."""
    return tuple(Collective(op=e.op, group="cp", size=shape["cp"], buffer_bytes=e.bytes,
                            count=e.count * layers * micro_steps, spans_nodes=spans_nodes, phase=e.phase)
                 for e in exchanges(scheme, **shape))
