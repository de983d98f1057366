"""Tensor-parallel layouts without a process group: part cutting/joining and mesh-shape parsing."""

from __future__ import annotations

import pytest
import torch

from zeroshard.comm.mesh import _from_mesh_shape  # the parser behind zs.init(mesh_shape=...)
from zeroshard.sharding.tp import canonical, to_local


@pytest.mark.parametrize("dim,chunks", [(0, 1), (0, 3), (1, 1)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parts_join_back_to_the_full_tensor(dim, chunks, tp):
    full = torch.arange(24 * 8, dtype=torch.float32).view(24, 8)
    placement = {"dim": dim, "chunks": chunks, "tp": tp}
    parts = [to_local(full, placement, r) for r in range(tp)]
    assert all(p.shape[dim] == full.shape[dim] // tp for p in parts)
    assert torch.equal(canonical(parts, placement), full)


def test_fused_chunks_give_each_rank_its_own_part_of_every_block():
    q, k, v = (torch.full((4, 2), float(i)) for i in range(3))
    part = to_local(torch.cat([q, k, v]), {"dim": 0, "chunks": 3, "tp": 2}, 1)
    assert part[:, 0].tolist() == [0, 0, 1, 1, 2, 2]  # rows 2-3 of q, of k and of v


def test_mesh_shape_parsing():
    assert _from_mesh_shape((2, 2), ("shard", "tp"), 4) == (2, 2)
    assert _from_mesh_shape((2, 2, 2), ("replicate", "shard", "tp"), 8) == (2, 2)
    assert _from_mesh_shape((4,), ("tp",), 4) == (1, 4)
    with pytest.raises(ValueError, match="covers 6 ranks but the world has 4"):
        _from_mesh_shape((2, 3), ("shard", "tp"), 4)
    with pytest.raises(ValueError, match="in that order"):
        _from_mesh_shape((2, 2), ("tp", "shard"), 4)
