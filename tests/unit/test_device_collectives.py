"""Every tensor the runtime hands a collective outside the hot path is on the group's device.

NCCL refuses host tensors, and a CPU-only suite never notices a CPU tensor handed to a collective:
gloo takes both. So these tests run the code under torch's FakeTensorMode with the mesh on "cuda"
(fake CUDA tensors need no GPU, and a CPU/CUDA mix in one op raises there as on a GPU) and record
the device of every tensor that reaches ``zeroshard.comm.collectives``. Numbers are the CPU suite's
business (tests/distributed); these check devices.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zeroshard.comm import collectives
from zeroshard.comm import mesh as meshes

CUDA = torch.device("cuda", 0)


class Seen(Exception):
    """Raised by the spy at the first collective: what follows is a host read of fake data."""


def fake_mesh(world: int = 2, device: torch.device = CUDA, **extra) -> SimpleNamespace:
    return SimpleNamespace(device=device, rank=0, world=world, backend="nccl", pp_rank=0, name="default",
                           group_size=lambda group: world, **extra)


@pytest.fixture
def devices(monkeypatch):
    """The devices of each collective's tensors, as (op, phase, [devices]); the spy stops at the first."""
    seen: list[tuple[str, str, list[torch.device]]] = []

    def spy(op):
        def call(*tensors, phase="", **kwargs):
            seen.append((op, str(phase), [t.device for t in tensors if isinstance(t, torch.Tensor)]))
            raise Seen(op)
        return call

    for op in ("all_gather", "all_reduce", "reduce_scatter", "broadcast"):
        monkeypatch.setattr(collectives, op, spy(op))
    return seen


def test_profiler_summary_gathers_on_the_group_device(monkeypatch, devices):
    from zeroshard.profile.step import StepProfiler

    monkeypatch.setattr(meshes, "_MESH", fake_mesh())
    prof = StepProfiler(rank=0, world=2, device=CUDA, batch=2, tokens_per_step=8)
    prof.steps = [{"step_s": 1.0, "comm_busy_s": 0.1, "comm_exposed_s": 0.05}]
    with FakeTensorMode(), pytest.raises(Seen):
        prof.summary()
    assert devices == [("all_gather", "metrics", [CUDA, CUDA])]


def test_desync_check_gathers_on_the_group_device(monkeypatch, devices):
    from zeroshard.comm import desync

    monkeypatch.setattr(meshes, "_MESH", fake_mesh())
    with FakeTensorMode(), pytest.raises(Seen):
        desync.check(3)
    assert devices == [("all_gather", "desync", [CUDA, CUDA])]
