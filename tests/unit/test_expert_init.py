"""A split expert param's init drawn one expert at a time is bitwise the rows of one whole draw,
and the random stream after it is the same (zeroshard/runtime/expert_init.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.runtime import expert_init
DRAWS = {
    "normal_": (nn.init.normal_, {"mean": 0.1, "std": 0.02}),
    "uniform_": (nn.init.uniform_, {"a": -0.3, "b": 0.2}),
    "zero_": (torch.Tensor.zero_, {}),
}


@pytest.mark.parametrize("name", list(DRAWS))
@pytest.mark.parametrize("shape", [(4, 8, 6), (6, 16, 3), (4, 5, 7)])
def test_rows_are_the_whole_draws_rows(name, shape):
    meta = torch.empty(shape, device="meta")
    func, kwargs = DRAWS[name]
    rowwise = expert_init.by_rows(name, meta, (meta,), torch.device("cpu"))
    # normal_ needs rows of whole 16-element blocks; the others take any row
    assert rowwise == (name != "normal_" or (shape[1] * shape[2]) % 16 == 0)
    if not rowwise:
        return
    torch.manual_seed(7)
    whole = torch.empty(shape)
    func(whole, **kwargs)
    after_whole = torch.rand(3)
    for first in range(0, shape[0], 2):
        torch.manual_seed(7)
        block = torch.full((2, *shape[1:]), float("nan"))
        expert_init.run_by_rows(func, name, block, first, shape[0], (meta,), kwargs)
        assert torch.equal(block, whole[first:first + 2]), (name, shape, first)
        assert torch.equal(torch.rand(3), after_whole)  # the stream goes on where one draw leaves it


def test_shape_reading_inits_views_and_accelerators_fall_back_to_the_whole_tensor():
    meta = torch.empty(4, 8, 6, device="meta")
    cpu = torch.device("cpu")
    assert not expert_init.by_rows("kaiming_uniform_", meta, (meta,), cpu)  # its fan reads the shape
    assert not expert_init.by_rows("trunc_normal_", meta, (meta,), cpu)  # not the same stream row by row
    assert not expert_init.by_rows("normal_", meta, (meta[1:],), cpu)  # a view of some experts
    assert not expert_init.by_rows("normal_", meta, (meta,), torch.device("cuda"))
    assert expert_init.by_rows("fill_", meta, (meta,), torch.device("cuda"))  # no draw: fine anywhere
