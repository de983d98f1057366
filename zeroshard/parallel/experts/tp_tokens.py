"""An MoE layer's tokens under tensor parallelism: each tp rank dispatches its share, all get the output.

Without sequence parallelism the MoE layer's input is replicated over a tp group (the attention's
row-wise output is all-reduced), and the experts are not tensor parallel. Each of the group's ``tp``
ranks therefore routes only its own run of the tokens through the experts, so every token reaches
its experts once per tp group, and the outputs are all-gathered over tp so that every tp rank
continues with the whole, replicated layer output.

Rank ``r`` owns tokens ``[r·c, (r+1)·c)`` with ``c = ceil(tokens / tp)`` (the last runs may be
short or empty; the gather pads each to ``c`` rows). The two autograd functions are each other's
backward:

- ``own_rows`` (forward: this rank's run; backward: all-gather of the runs' grads). The rest of the
  model is computed replicated, so every tp rank must end with the whole input grad: the expert
  path's part of it exists only on the rank that dispatched the token.
- ``all_rows`` (forward: all-gather of the runs; backward: this rank's run of the grad). The
  incoming grad is the same whole grad on every tp rank, so taking the own run (not a sum over
  tp) gives each token's grad once.

Every gather goes through the comm gateway on the dense mesh's tp group, in the ledger with group
``tp``, the layer's name as unit and phase forward or backward.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.comm import collectives
from zeroshard.comm.names import Group, Phase


def run_of(tokens: int, tp: int, tp_rank: int) -> tuple[int, int, int]:
    """(start, stop, c): tp rank ``tp_rank``'s run of ``tokens`` rows, and the padded run length."""
    chunk = -(-tokens // tp)
    start = min(tp_rank * chunk, tokens)
    return start, min(start + chunk, tokens), chunk


def _gather_runs(run: torch.Tensor, tokens: int, *, unit: str, phase: Phase, mesh: Any) -> torch.Tensor:
    """Every tp rank's run of rows (rank order), padded to equal length for the gather, cut to ``tokens``."""
    tp = mesh.tp_size
    _, _, chunk = run_of(tokens, tp, 0)
    padded = run.new_zeros((chunk,) + tuple(run.shape[1:]))
    padded[:run.shape[0]] = run
    whole = run.new_empty((tp * chunk,) + tuple(run.shape[1:]))
    collectives.all_gather(whole.view(-1), padded.view(-1), group=Group.TP, unit=unit, phase=phase, mesh=mesh)
    return whole[:tokens]


class _OwnRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, unit, mesh):  # type: ignore[override]
        ctx.tokens, ctx.unit, ctx.mesh = rows.shape[0], unit, mesh
        start, stop, _ = run_of(rows.shape[0], mesh.tp_size, mesh.tp_rank)
        return rows[start:stop].clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        whole = _gather_runs(grad.contiguous(), ctx.tokens, unit=ctx.unit, phase=Phase.BACKWARD, mesh=ctx.mesh)
        return whole, None, None


class _AllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, tokens, unit, mesh):  # type: ignore[override]
        ctx.tokens, ctx.mesh = tokens, mesh
        return _gather_runs(run.contiguous(), tokens, unit=unit, phase=Phase.FORWARD, mesh=mesh)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        start, stop, _ = run_of(ctx.tokens, ctx.mesh.tp_size, ctx.mesh.tp_rank)
        return grad[start:stop].clone(), None, None, None


def own_rows(rows: torch.Tensor, *, unit: str, mesh: Any) -> torch.Tensor:
    """This tp rank's run of the replicated ``rows`` (dim 0 = tokens); its backward all-gathers over tp."""
    return _OwnRows.apply(rows, unit, mesh)


def all_rows(run: torch.Tensor, tokens: int, *, unit: str, mesh: Any) -> torch.Tensor:
    """The ``tokens`` rows of every tp rank's ``run``, on every tp rank; its backward keeps the own run."""
    return _AllRows.apply(run, tokens, unit, mesh)
