"""Token dispatch and combine over the ep group, through the comm gateway.

Each MoE layer call exchanges, over ``ep``: the per-expert token counts (an even all-to-all of
``ep × experts-per-rank`` int64), then the routed rows (``all_to_all_single`` with uneven splits)
to the ranks holding their experts, and the expert outputs back the same way. Backward runs the
two row exchanges in reverse with the splits swapped. All four are recorded in the ledger with
group ``ep``, the layer's name as the unit and phase forward or backward, so a step's all-to-all
bytes are exactly ``(rows sent + rows received) × hidden × element size × 2`` per layer call plus
the counts.

The counts cross to the host because the row exchange needs its split sizes there: one
device-to-host sync per MoE layer call (both count tables in one copy, ``host_sync`` "moe.splits").
It is unavoidable with variable splits; torchtitan pays it too, and it is why a prefetch must not depend on it (stage 3 issues its
gathers from hooks before the layer runs).
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.comm import collectives
from zeroshard.comm.names import Group, Phase


def exchange_counts(send_counts: torch.Tensor, *, unit: str, mesh: Any) -> torch.Tensor:
    """``send_counts[d, l]`` rows for expert ``l`` of ep rank ``d`` -> ``recv[s, l]`` rows from ep rank
    ``s`` for this rank's expert ``l``."""
    send = send_counts.contiguous()
    recv = torch.empty_like(send)
    collectives.all_to_all(recv.view(-1), send.view(-1), group=Group.EP, unit=unit, phase=Phase.FORWARD, mesh=mesh)
    return recv


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], unit: str, phase: Phase, mesh: Any) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    collectives.all_to_all(out, rows, group=Group.EP, unit=unit, phase=phase, mesh=mesh, output_splits=recv,
                           input_splits=send)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of the ep group (``send[d]`` to rank d, ``recv[s]`` from rank s); its
    backward sends the rows' grads back the same way."""

    @staticmethod
    def forward(ctx, rows, send, recv, unit, mesh):  # type: ignore[override]
        ctx.send, ctx.recv, ctx.unit, ctx.mesh = send, recv, unit, mesh
        return _exchange(rows, send, recv, unit, Phase.FORWARD, mesh)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _exchange(grad, ctx.recv, ctx.send, ctx.unit, Phase.BACKWARD, ctx.mesh), None, None, None, None


def all_to_all_rows(rows: torch.Tensor, send: list[int], recv: list[int], *, unit: str, mesh: Any) -> torch.Tensor:
    """Differentiable uneven all-to-all of ``rows`` over the ep group of ``mesh``."""
    return _AllToAll.apply(rows, send, recv, unit, mesh)
