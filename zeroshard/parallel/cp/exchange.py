"""The cp group's two exchanges, as autograd functions over zeroshard/comm/ (recorded under "cp").

``gather_seq``: every rank's keys/values, concatenated in cp-rank order (ring attention). Its
backward is the reduce-scatter of the gradients: each rank's keys were read by every rank's queries,
so their gradient is the sum of every rank's contribution.

``seq_to_heads`` / ``heads_to_seq``: Ulysses' all-to-all, from a piece of the sequence with every
head to the whole sequence with a slice of the heads, and back; each is the other's backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zeroshard.comm import collectives
from zeroshard.comm.names import Group, Phase

if TYPE_CHECKING:
    from zeroshard.comm.mesh import Mesh

UNIT = "cp.attention"
"""What the ledger names these exchanges' unit."""


def _all_gather_seq(x: torch.Tensor, mesh: Mesh, phase: Phase) -> torch.Tensor:
    """(B, H, t, D) on each rank -> (B, H, cp * t, D): rank j's tokens at [j * t, (j + 1) * t)."""
    cp = mesh.cp_size
    src = x.transpose(0, 2).contiguous()  # (t, H, B, D): one rank's block is one contiguous run
    out = torch.empty((cp * src.shape[0], *src.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.all_gather(out.view(-1), src.view(-1), group=Group.CP, unit=UNIT, phase=phase, mesh=mesh)
    return out.transpose(0, 2)


def _reduce_scatter_seq(g: torch.Tensor, mesh: Mesh, phase: Phase) -> torch.Tensor:
    """The inverse of ``_all_gather_seq`` for gradients: rank j's block of the sum over ranks."""
    cp = mesh.cp_size
    src = g.transpose(0, 2).contiguous()  # (cp * t, H, B, D)
    out = torch.empty((src.shape[0] // cp, *src.shape[1:]), dtype=g.dtype, device=g.device)
    collectives.reduce_scatter(out.view(-1), src.view(-1), group=Group.CP, unit=UNIT, phase=phase, mesh=mesh)
    return out.transpose(0, 2)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, phase: Phase) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh = mesh
        return _all_gather_seq(x, mesh, phase)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return _reduce_scatter_seq(g, ctx.mesh, Phase.BACKWARD), None, None


def gather_seq(x: torch.Tensor, mesh: Mesh, phase: Phase = Phase.FORWARD) -> torch.Tensor:
    """Every cp rank's (B, H, t, D) concatenated along the sequence, differentiable; ``phase`` says
    whether it is forward's gather or backward's recompute of it."""
    return _GatherSeq.apply(x, mesh, phase)


def _a2a(x: torch.Tensor, mesh: Mesh, phase: Phase, *, to_heads: bool) -> torch.Tensor:
    """to_heads: (B, H, t, D) -> (B, H / cp, cp * t, D); else the inverse."""
    cp = mesh.cp_size
    B, H, T, D = x.shape
    if to_heads:  # head slice i goes to rank i; rank j's tokens come back as piece j of the sequence
        src = x.reshape(B, cp, H // cp, T, D).transpose(0, 1).contiguous()  # (cp, B, H/cp, t, D)
    else:  # piece i of the sequence goes back to rank i; rank j's reply is head slice j
        src = x.reshape(B, H, cp, T // cp, D).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, h, t, D)
    out = torch.empty_like(src)
    collectives.all_to_all(out.view(-1), src.view(-1), group=Group.CP, unit=UNIT, phase=phase, mesh=mesh)
    if to_heads:  # (cp_src, B, h, t, D) -> (B, h, cp * t, D)
        return out.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * T, D)
    return out.transpose(0, 1).reshape(B, cp * H, T // cp, D)  # (cp_src, B, h, t, D) -> (B, H, t, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, to_heads: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh, ctx.to_heads = mesh, to_heads
        return _a2a(x, mesh, Phase.FORWARD, to_heads=to_heads)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return _a2a(g.contiguous(), ctx.mesh, Phase.BACKWARD, to_heads=not ctx.to_heads), None, None


def seq_to_heads(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Ulysses' first all-to-all: (B, H, t, D) -> (B, H / cp, cp * t, D), differentiable."""
    return _SeqToHeads.apply(x, mesh, True)


def heads_to_seq(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Ulysses' second all-to-all: (B, H / cp, cp * t, D) -> (B, H, t, D), differentiable."""
    return _SeqToHeads.apply(x, mesh, False)
