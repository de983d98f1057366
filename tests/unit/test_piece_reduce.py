"""Gloo's piece reductions (stages 2-3), the cut and the rebuild of this rank's shard, without a
second rank (what the collective would sum is left as it is): the grad shard ``own_sums`` leaves
owns its storage. A unit of one large param cut at two shards once returned a view of that
param's grad as rank 0's shard, keeping the whole grad alive (twice the shard); small grads are
packed with one concatenation per owner. Values: the grads' own, slot by slot."""

from __future__ import annotations

import pytest
import torch

from zeroshard.runtime.layout import FlatLayout
from zeroshard.runtime.reduce import SMALL_GRAD_NUMEL, GradReducer, ReduceTarget

SIDE = 256  # a 256 x 256 weight is SMALL_GRAD_NUMEL elements: a large piece


def _reducer(shapes: list[torch.Size], shard_rank: int) -> GradReducer:
    layout = FlatLayout([(f"p{i}", s) for i, s in enumerate(shapes)], shards=2)
    lo, hi = layout.shard_range(shard_rank)
    target = ReduceTarget(unit="u", layout=layout, shard_rank=shard_rank, lo=lo, hi=hi, reduce_dtype=torch.float32,
                          master_dtype=torch.float32, device=torch.device("cpu"))
    return GradReducer(target, mesh=None, shard_optimizer=True)  # type: ignore[arg-type]  # no collective here


@pytest.mark.parametrize("shapes", [[torch.Size([SIDE, SIDE])],
                                    [torch.Size([8, SIDE]), torch.Size([8]), torch.Size([8])],
                                    [torch.Size([8]), torch.Size([SIDE, SIDE]), torch.Size([8])]],
                         ids=["one-large", "small-only", "mixed"])
@pytest.mark.parametrize("shard_rank", [0, 1])
def test_this_ranks_shard_is_its_own_storage_and_the_grads_values(shapes, shard_rank):
    assert SIDE * SIDE >= SMALL_GRAD_NUMEL
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    reducer = _reducer(shapes, shard_rank)
    pieces = reducer.pieces(grads)
    assert pieces is not None
    shard = reducer.own_sums(pieces)
    assert shard.untyped_storage().nbytes() == shard.nbytes  # never a view into a larger grad
    layout = reducer.target.layout
    full = torch.zeros(layout.numel)
    for slot, grad in zip(layout.slots, grads):
        full[slot.offset:slot.end] = grad.view(-1)
    lo, hi = layout.shard_range(shard_rank)
    assert torch.equal(shard, full[lo:hi])
