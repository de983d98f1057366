"""Meta-device init of a split expert param: draw the stacked experts row by row, keep this rank's.

A rank of an expert-parallel model holds rows [first, first + count) of dim 0 of each stacked
expert param (zeroshard/runtime/expert_placement.py). Seed-exact init (zeroshard/runtime/materialize.py) must
consume the random stream as a plain build drawing the whole (experts, ...) tensor does, yet a
rank should never hold that whole tensor: at scale it is the largest param of the model. So the
replay draws it one expert (dim-0 row) at a time into a scratch row and copies only the kept rows
into a block of ``count`` rows.

Row by row is the same stream as one call only for draws that fill elements in order from the
generator: on the CPU, ``uniform_`` (element-serial) and ``normal_`` when a row holds a multiple
of 16 elements (torch's CPU normal fills 16-element blocks from a run of uniforms, so rows of whole
blocks line up with the blocks of one call); tests/unit/test_expert_init.py holds them to that, and
shows ``trunc_normal_`` does not qualify. Fills draw nothing and are applied to the kept rows only. Anything else (an
init that reads the tensor's shape, such as ``kaiming_uniform_``'s fan; a view; an accelerator's
generator, whose offsets advance per call) falls back to the whole tensor as for a dense param.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

ROW_DRAWS = ("uniform_", "normal_")
"""Draws whose random stream row by row is the one of a single call (see the module note)."""
ROW_FILLS = ("zero_", "zeros_", "ones_", "fill_", "constant_")
"""Overwrites that draw nothing: done on the kept rows alone."""
_NORMAL_BLOCK = 16


def rows_kept(param: torch.Tensor) -> tuple[torch.Size, tuple[int, int]] | None:
    """(the stacked shape, (first row, rows)) for an expert param split over ep; None otherwise."""
    from zeroshard.runtime.expert_placement import expert_mesh_of, expert_rows

    mesh = expert_mesh_of(param)  # type: ignore[arg-type]  # any tensor may carry the mark
    if mesh is None:
        return None
    whole, _ = expert_rows(mesh, param.shape)
    if whole == param.shape:
        return None  # ep 1: the rank holds every expert
    return whole, (mesh.ep_rank * param.shape[0], param.shape[0])


def is_whole(value: Any, meta: torch.Tensor) -> bool:
    """``value`` is ``meta`` itself (or ``.data`` of it), not a view of part of it."""
    return isinstance(value, torch.Tensor) and value.shape == meta.shape and value.stride() == meta.stride() \
        and value.storage_offset() == 0


def by_rows(name: str, meta: torch.Tensor, args: tuple, device: torch.device) -> bool:
    """Can init call ``name`` on ``args[0]`` be replayed row by row, bitwise as one call?"""
    if not args or not is_whole(args[0], meta) or not meta.is_contiguous() or meta.dim() < 2:
        return False
    if name in ROW_FILLS:
        return True
    if name not in ROW_DRAWS or device.type != "cpu":
        return False
    row_numel = meta[0].numel()
    return name == "uniform_" or row_numel % _NORMAL_BLOCK == 0


def run_by_rows(func: Callable, name: str, block: torch.Tensor, first: int, whole_rows: int,
                args: tuple, kwargs: dict) -> None:
    """Apply init ``func`` to the stacked tensor, holding only its rows [first, first + len(block))."""
    rest = args[1:]
    if name in ROW_FILLS:
        func(block, *rest, **kwargs)
        return
    row = torch.empty(block.shape[1:], dtype=block.dtype, device=block.device)
    for index in range(whole_rows):
        func(row, *rest, **kwargs)
        if first <= index < first + block.shape[0]:
            block[index - first].copy_(row)
