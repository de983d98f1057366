"""Context parallelism in a plan: each rank's activations are those of its ``seq / cp`` tokens, one
layer's attention at a time holds the exchange's buffers (``transient_bytes``). The exchanges
themselves are the runtime's step schedule's (``step_schedule(cp=...)``, sized by
zeroshard/parallel/cp/volume.py), so the ledger, the planner and the simulator agree.
"""

from __future__ import annotations

import dataclasses

from zeroshard.parallel.cp.volume import transient_bytes
from zeroshard.tools.planner.activations import ActivationEstimate


def cp_shape(*, cp: int, rows: int, seq: int, q_width: int, kv_width: int, elem: int) -> dict[str, int]:
    return dict(cp=cp, rows=rows, seq=seq, q_width=q_width, kv_width=kv_width, elem=elem)


def with_exchange(act: ActivationEstimate, scheme: str, shape: dict[str, int]) -> ActivationEstimate:
    """``act`` (already of ``seq / cp`` tokens) with one layer's exchange buffers next to a block's
    backward temporaries, where a layer's attention runs."""
    extra = transient_bytes(scheme, **shape)
    block = act.block + extra
    return dataclasses.replace(act, block=block, workspace=max(act.head, block))
