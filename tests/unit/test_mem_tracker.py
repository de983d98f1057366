"""The MemTracker every measured peak reads (plan --measure, tune) takes a model with a frozen param."""

import pytest
import torch
from torch import nn

from zeroshard.tools.planner.mem_tracker import memory_tracker


def _step(tracker, model: nn.Module) -> dict:
    tracker.track_external(model)
    with tracker:
        model(torch.ones(2, 8)).sum().backward()
    return {str(k): v for k, v in tracker.get_tracker_snapshot()[torch.device("cpu")].items()}


@pytest.mark.filterwarnings("ignore:global module forward hook")
def test_a_frozen_param_is_measured_and_has_no_grad_bytes():
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    model[0].weight.requires_grad_(False)  # as Ernie 4.5 MoE keeps its e_score_correction_bias
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        _step(MemTracker(), model)  # torch's own: what tune and plan --measure failed with
    model.zero_grad(set_to_none=True)
    got = _step(memory_tracker(), model)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)  # fp32 grads: 8 + 32 + 4 floats
    assert got["_MemRefType.GRAD"] == trainable == 176
    assert got["_MemRefType.PARAM"] == sum(p.numel() * 4 for p in model.parameters())
