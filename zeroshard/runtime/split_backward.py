"""The engine's side of a pipeline schedule: split backward (zero-bubble schedules) and the
accumulated and reduced grads a pipeline reads by name (a tied param's two stages sum there).

torch's ``stage_backward_input`` / ``stage_backward_weight`` run the two halves of a backward
without the accumulate-grad hooks that drive the engine otherwise, so stage 3's gathers and frees
and the taking of the grads happen here, called by ``Engine``'s methods of the same names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zeroshard.comm.names import Phase

if TYPE_CHECKING:
    from zeroshard.runtime.engine import Engine


def input_backward_done(engine: Engine) -> None:
    """The input half of a split backward has run for one microbatch: torch's
    ``stage_backward_input`` differentiates to the stage's inputs only, so no param's
    accumulate-grad hook fired and nothing resharded stage 3's blocks. Free them here; the
    next forward, input half or weight half gathers them again. (``Engine`` drops its pending
    backward prefetch first.)"""
    reshard_units(engine, root=False)


def reshard_units(engine: Engine, *, root: bool) -> None:
    """Stage 3: free every unit's gathered params (the root's too when ``root``)."""
    if engine.policy.shard_params:
        for unit in engine.units:
            if root or not unit.is_root:
                unit.reshard()


def gather_for_split_backward(engine: Engine) -> None:
    """Stage 3: gather every unit before either half of a split backward. torch finds the
    params each half differentiates to through the module's registered params, which are the
    unsharded ones only while gathered, and the weight half's graph reads the full params (a
    layer norm's weight, a linear's transposed weight)."""
    for unit in engine.units:
        unit.unshard(Phase.BACKWARD)
    for unit in engine.units:
        unit.wait_unshard()
    engine.track_memory()


def split_backward_done(engine: Engine) -> None:
    """Every microbatch's weight half has run: stage 3 frees every unit, the root included,
    which the hooked backward's end would have done (the next step gathers the updated values)."""
    reshard_units(engine, root=True)


def take_assigned_grads(engine: Engine) -> None:
    """Take the grads a split backward's weight half assigned to ``param.grad`` itself (torch's
    ``stage_backward_weight`` computes them with ``torch.autograd.grad``, which runs no
    accumulate-grad hook) into the flat grad buffers, as the hooks do under ``no_sync``, and
    free stage 3's blocks again. A param whose grad a hook already took holds none (stages 2-3)
    or our own buffer view (stages 0-1), so calling this after a hooked backward changes nothing.
    Where stages 2-3 reduce inside ``no_sync`` (``reduces_inside_no_sync``), the grads taken are
    reduce-scattered at once instead, every unit in the fixed order, as a hooked backward's end does."""
    if engine.sync_grads:
        raise RuntimeError("take_assigned_grads runs inside no_sync (a pipeline schedule's backward passes)")
    reduce_now = engine.reduces_inside_no_sync
    if reduce_now:
        engine.finish_reductions()  # the previous microbatch's, so this one's launch from the first unit
    took_any = False
    for unit in engine.units:
        took = False
        for group_index, group in enumerate(unit.groups):
            if not group.trainable or group.params is None:
                continue
            for param_index, param in enumerate(group.created_params()):
                if param.grad is not None:
                    unit.mark_ready(group_index, param_index)
                    took = True
        took_any |= took
        if took and not reduce_now:
            unit.collect_grads()
            unit.clear_ready()
    reshard_units(engine, root=False)
    if reduce_now and took_any:
        engine.reductions.launch_all()
        engine.reap_finished()


def accumulated_grad(engine: Engine, fqn: str) -> torch.Tensor:
    """The full grad of param ``fqn`` accumulated under ``no_sync`` and not yet reduced: a flat
    view into its group's grad buffer, which a caller may change in place before
    ``reduce_accumulated`` (a pipeline sums a tied param's two stages' grads there)."""
    group, slot = slot_of(engine, fqn)
    return group.full_grads()[slot.offset:slot.end]


def slot_of(engine: Engine, fqn: str):
    """The trainable flat group holding param ``fqn``, and the param's slot in it."""
    for group in engine.trainable_groups:
        for slot in group.layout.slots:
            if slot.fqn == fqn:
                return group, slot
    raise KeyError(f"no trainable param {fqn!r} in this engine")


def reduced_grad_piece(engine: Engine, fqn: str) -> tuple[torch.Tensor, int, int]:
    """The part of param ``fqn``'s reduced grad in this rank's grad shard, after the reductions
    finished: ``(view, first, numel)``, the view holding the param's elements from ``first`` on
    (empty where the shard holds none of it) and ``numel`` the whole param's. A caller may change
    the view in place (a pipeline sums a tied param's two stages' reduced grads there)."""
    engine.finish_reductions()
    group, slot = slot_of(engine, fqn)
    shard = group.grad_shard
    if shard is None:
        raise RuntimeError(f"param {fqn!r} has no reduced grad yet: call it after the backward")
    lo, hi = max(slot.offset, group.lo), min(slot.end, group.hi)
    if hi <= lo:
        return shard[:0], 0, slot.numel
    return shard[lo - group.lo:hi - group.lo], lo - slot.offset, slot.numel


def reduce_accumulated(engine: Engine) -> None:
    """Launch, in the fixed order, the reductions of the grads accumulated under ``no_sync``,
    without another backward: a pipeline stage runs every microbatch's backward deferred and
    reduces once after the schedule (zeroshard/parallel/pipeline/runtime.py). Call it outside ``no_sync``;
    a grad read finishes the reductions as after a synchronising backward. (``Engine`` checks it
    runs outside ``no_sync`` and outside a backward.)"""
    engine.reductions.launch_rest()
    engine.reap_finished()
