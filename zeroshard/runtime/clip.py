"""Global gradient-norm clipping over every shard."""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.comm import collectives, host_sync
from zeroshard.comm.names import Group, Phase
from zeroshard.runtime import guard
from zeroshard.runtime.engine import get_engine
from zeroshard.runtime.tp import tp_sharded_ranges


def grad_norm(model: nn.Module) -> torch.Tensor:
    """The global L2 norm of the averaged gradient, the same on every rank.

    Squares are summed in float64: an fp32 square is exact in fp64, so the total barely depends on
    how the elements are split across ranks, and the fp32 result is the same for DDP and every
    ZeRO stage. Replicas (hybrid sharding) hold identical shards, so only the shard group is summed;
    a tied param has one storage and is counted once. Under tensor parallelism the squares of
    tp-sharded params are also summed over the tp dim; replicated params (norms) count once.
    Expert params (zeroshard/parallel/experts/) live on the expert mesh: their squares are summed over its
    shard group (the ranks holding the same experts, when sharded) and its ep group (the other
    experts), so each expert element is counted once, next to each dense one.
    """
    return grad_norm_of(get_engine(model))


def grad_norm_of(engine, *, phase: Phase = Phase.CLIP) -> torch.Tensor:
    """``grad_norm`` of an engine; a loss noted to the non-finite guard is folded into its squares,
    so a non-finite loss on any rank makes the norm non-finite (zeroshard/runtime/guard.py, which
    computes it under its own ``phase`` when the step did not clip)."""
    total = local_squares(engine)
    guard.fold_loss(engine, total)
    sum_squares_over_shards(total, engine, phase=phase)
    return total[0].sqrt().to(torch.float32)


def guard_norm(engine) -> torch.Tensor:
    """The global grad norm the non-finite guard reads on a step that did not clip."""
    return grad_norm_of(engine, phase=Phase.GUARD)


SQUARE_CHUNK = 1 << 22
"""Grad elements squared at a time: a chunk's float64 copy (32 MiB) is clipping's whole temporary
memory, however large the grad shard (a whole-shard float64 square would be twice its fp32 bytes
again, on top of a copy, at the moment every grad is alive)."""


def square_sum(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The float64 sum of squares of ``t[start:stop]``, one chunk at a time (each square is exact)."""
    sums = [t[a:min(a + SQUARE_CHUNK, stop)].to(torch.float64, copy=True).square_().sum()
            for a in range(start, stop, SQUARE_CHUNK)]
    if len(sums) == 1:  # the common case: no extra tensor on the step's path
        return sums[0]
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64, device=t.device)


def ranges_without(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` less the (sorted, disjoint) ``holes``."""
    out = []
    for start, stop in ranges:
        for a, b in holes:
            if a >= stop or b <= start:
                continue
            if a > start:
                out.append((start, a))
            start = max(start, b)
        if start < stop:
            out.append((start, stop))
    return out


def local_squares(engine, skip: frozenset[str] = frozenset()) -> torch.Tensor:
    """This rank's float64 [dense squares, squares of tp-sharded params, expert squares] of the grad
    shards, leaving out the params named in ``skip`` (a pipeline's copy of a tied param, counted on
    its owner)."""
    device = engine.mesh.device
    # [all dense squares, squares of tensor-parallel-sharded params, expert squares]: a tp-sharded
    # param's parts differ across tp ranks and are summed over tp too; a replicated one is counted once.
    total = torch.zeros(3, dtype=torch.float64, device=device)
    for group in engine.trainable_groups:
        grad = group.grad_shard
        if grad is None:
            continue
        if group.mesh is not engine.mesh:
            total[2] += square_sum(grad, 0, grad.numel())
            continue
        holes = sorted((p.start - group.lo, p.stop - group.lo) for p in group.layout.pieces(group.shard_rank)
                       if group.layout.slots[p.slot_index].fqn in skip) if skip else []
        for start, stop in ranges_without([(0, grad.numel())], holes) if holes else ((0, grad.numel()),):
            total[0] += square_sum(grad, start, stop)
        if group.any_tp:
            for start, stop in ranges_without(tp_sharded_ranges(group), holes):
                total[1] += square_sum(grad, start, stop)
    return total


def sum_squares_over_shards(total: torch.Tensor, engine, *, phase: Phase = Phase.CLIP) -> None:
    """``local_squares`` summed over the shard group, tp-sharded params over tp and expert params
    over the expert mesh, in place: ``total[0]`` is then the squared norm over the engine's whole model."""
    if engine.policy.shard_optimizer and engine.mesh.shard_size > 1:
        collectives.all_reduce(total[:2], group=Group.SHARD, phase=phase, mesh=engine.mesh)
    if engine.mesh.tp_size > 1:
        tp_part = total[1:2].clone()
        collectives.all_reduce(tp_part, group=Group.TP, phase=phase, mesh=engine.mesh)
        total[0] += tp_part[0] - total[1]
    experts = engine.mesh.experts
    if experts is not None:
        # Sharded: every rank holds a distinct piece (edp x ep is the world); else only ep differs.
        over = Group.WORLD if engine.policy.shard_optimizer else Group.EP
        expert_part = total[2:3].clone()
        collectives.all_reduce(expert_part, group=over, phase=phase, mesh=experts)
        total[0] += expert_part[0]


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale the gradient shards so the global norm is at most ``max_norm``; return the norm before clipping.
    The norm is also the non-finite guard's flag: the optimizer's step skips when it is not finite."""
    engine = get_engine(model)
    guard.inject_fault(engine)  # ZEROSHARD_GRAD_FAULT, for the guard's tests; else nothing
    norm = grad_norm_of(engine)
    guard.note_norm(engine, norm)
    scale_grad_shards(engine.trainable_groups, norm, max_norm)
    return norm


def scale_grad_shards(groups, norm: torch.Tensor, max_norm: float) -> None:
    """Multiply every group's grad shard by the clip coefficient of ``norm`` (computed where the norm
    is, on the mesh's device). An offloaded (host) shard is scaled by a host copy of it, made once:
    a CPU tensor cannot be multiplied by a CUDA one, only the reverse."""
    # Same arithmetic as torch.nn.utils.clip_grad_norm_: always multiply by the clamped coefficient.
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    # A non-finite norm leaves the grads as they are: the guard skips that step, and its diagnosis
    # must find the non-finite values where they arose, not spread over every shard by a NaN coefficient.
    coef = torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))
    host_coef: float | None = None
    for group in groups:
        grad = group.grad_shard
        if grad is None:
            continue
        if grad.device == coef.device:
            grad.mul_(coef.to(grad.dtype))
            continue
        if host_coef is None:  # one named host read of the scalar per step, not a blocking tensor copy
            host_coef = float(host_sync.item(coef, "clip.coef_to_host", fake_value=1.0))
        grad.mul_(host_coef)
