"""Which of a traced forward's tensors a tensor-parallel rank holds only its part of.

The model's own TP plan (its spec's, as ``zeroshard.runtime.tp`` applies it) says where the split
starts and ends; the forward's ops say where it flows in between, so no activation is assumed split
or whole by its name or shape. A column-split linear (``colwise``, ``packed_colwise``) leaves its
output split over the tp ranks (each rank its heads, its MLP columns); every op that reads a split
tensor makes split tensors (a view into heads, rotary, attention, the gated MLP's product); a
row-split linear (``rowwise``, ``rowwise_split_input``) and a column split that gathers its output
return a whole tensor (the all-reduce, the all-gather), as does a vocabulary-split embedding. The
residual stream, the norms and the loss stay whole. A split tensor's bytes on one rank are its
bytes / tp (the plan's divisibility checks make the split even).

Under sequence parallelism the stream between the blocks' projections is split along the sequence
too; that flow is not followed here (the whole-rank figure is kept, an upper bound).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zeroshard.runtime.tp_plan import (COLWISE, COLWISE_GATHER, EMBEDDING_ROWWISE, PACKED_COLWISE, ROWWISE,
                                       ROWWISE_SPLIT, TPPlan, resolve)

SPLITS_OUTPUT = (COLWISE, PACKED_COLWISE)
"""Styles whose module's output is split over the tp ranks."""
WHOLE_OUTPUT = (ROWWISE, ROWWISE_SPLIT, COLWISE_GATHER, EMBEDDING_ROWWISE)
"""Styles whose module returns a whole tensor (its collective reassembles it)."""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # noqa: SLF001 - a storage's identity; fake storages have no data_ptr


class SplitFlow(TorchDispatchMode):
    """Storages of the forward that are split over the tp ranks: marked at the plan's column splits,
    carried by every op that reads one, and cleared at the modules that reassemble them."""

    def __init__(self) -> None:
        super().__init__()
        self.split: set[int] = set()
        self.held: list[torch.Tensor] = []
        """Every split tensor, kept alive: a freed fake storage's identity may be taken by a new one."""

    def is_split(self, t: torch.Tensor) -> bool:
        return _key(t) in self.split

    def mark(self, output: Any, split: bool) -> None:
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and split:
                self.split.add(_key(t))
                self.held.append(t)
            elif isinstance(t, torch.Tensor):
                self.split.discard(_key(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and _key(t) in self.split for t in tree_leaves((args, kwargs))):
            self.mark(out, True)
        return out


@contextlib.contextmanager
def split_flow(model: nn.Module, plan: TPPlan | None) -> Iterator[SplitFlow | None]:
    """A ``SplitFlow`` over ``model``'s forward, its plan's modules hooked (None without a plan: nothing
    is split). Enter it inside the fake mode, so the flow sees every op the model runs."""
    if plan is None:
        yield None
        return
    listed = cast(nn.ModuleList, model.get_submodule(plan.blocks))
    styles = {f"{plan.blocks}.{i}.{name}": style for i, block in enumerate(listed)
              for name, style in resolve(block, plan.styles, f"{plan.blocks}.{i}.").items()}
    styles.update(resolve(model, plan.outer, ""))
    flow = SplitFlow()
    handles = []
    for name, style in styles.items():
        if style in SPLITS_OUTPUT or style in WHOLE_OUTPUT:
            split = style in SPLITS_OUTPUT
            handles.append(model.get_submodule(name).register_forward_hook(
                lambda module, args, output, split=split: flow.mark(output, split)))
    try:
        with flow:
            yield flow
    finally:
        for h in handles:
            h.remove()
