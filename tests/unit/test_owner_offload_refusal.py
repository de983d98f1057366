"""Per-tensor owners with disk offload are refused by name (the disk step is sliced; a whole tensor
cannot be), on one rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard as zs


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    zs.init()
    yield
    zs.shutdown()


def test_muon_with_disk_offload_is_refused_by_name(tmp_path):
    model = zs.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), stage=3,
                     offload=zs.OffloadPolicy(kind="disk", directory=str(tmp_path)))
    with pytest.raises(ValueError, match="offload='disk'.*use offload='cpu'"):
        zs.optimizer(model, torch.optim.AdamW, lr=1e-3, param_groups=[
            {"params": ["0.weight", "1.weight"], "optimizer": torch.optim.Muon},
            {"params": ["0.bias", "1.bias"]}])
