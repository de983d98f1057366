"""The collective layer's device contract and the named host-sync counter (issue 46, item 2).

A mesh built by hand says its device is ``cuda`` (the group an NCCL world would have); every
collective given a host tensor is then refused before anything is issued, naming the op, the phase
and the tensor's device. No GPU and no process group are needed: the check runs first.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zeroshard.comm import collectives, host_sync
from zeroshard.comm import devices as devices_mod
from zeroshard.comm.collectives import DeviceContractError
from zeroshard.comm.dims import ParallelDims
from zeroshard.comm.ledger import Ledger
from zeroshard.comm.mesh import Mesh


def _mesh(device: str, backend: str, world: int = 2) -> Mesh:
    return Mesh(rank=0, dims=ParallelDims.of(world), device=torch.device(device), backend=backend,
                world_group=None, shard_group=None, replicate_group=None, ledger=Ledger())


CALLS = {
    "all_reduce": lambda t, m: collectives.all_reduce(t, phase="metrics", mesh=m),
    "all_gather": lambda t, m: collectives.all_gather(torch.empty(2 * t.numel()), t, phase="summary", mesh=m),
    "reduce_scatter": lambda t, m: collectives.reduce_scatter(t[:1], t, phase="backward", mesh=m),
    "all_to_all": lambda t, m: collectives.all_to_all(torch.empty_like(t), t, phase="forward", mesh=m),
    "broadcast": lambda t, m: collectives.broadcast(t, phase="init", mesh=m),
}


@pytest.mark.parametrize("op", sorted(CALLS))
def test_a_host_tensor_is_refused_by_a_cuda_group_by_name(op):
    mesh = _mesh("cuda:0", "nccl")
    with pytest.raises(DeviceContractError) as info:
        CALLS[op](torch.zeros(2), mesh)
    message = str(info.value)
    assert message.startswith(f"{op} in phase ")
    assert "got a tensor on cpu" in message and "runs on cuda:0" in message and "\n" not in message
    assert mesh.ledger.next_seq == 0  # refused before anything was recorded or issued


def test_a_tensor_on_the_groups_device_passes():
    mesh = _mesh("cpu", "gloo", world=1)
    t = torch.ones(4)
    collectives.all_reduce(t, op="sum", phase="metrics", mesh=mesh)  # a one-rank group: the tensor is the result
    assert t.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert mesh.ledger.next_seq == 1


def test_the_phase_is_named_in_the_refusal():
    with pytest.raises(DeviceContractError, match="all_gather in phase 'desync' got a tensor on cpu"):
        collectives.all_gather(torch.empty(4), torch.zeros(2), phase="desync", mesh=_mesh("cuda:0", "nccl"))


def test_a_backend_can_be_declared_to_run_on_a_device(monkeypatch):
    monkeypatch.setattr(devices_mod, "_BACKEND_DEVICES", {})
    assert devices_mod.local_rank_device("fake") == torch.device("cpu")
    devices_mod.declare_backend_device("fake", "cuda")
    assert devices_mod.local_rank_device("fake") == torch.device("cuda", 0)


def test_host_syncs_are_counted_by_place_and_host_reads_are_not():
    host_sync.reset()
    assert host_sync.item(torch.tensor(3.0), "test.cpu") == 3.0
    assert host_sync.counts() == {}  # a host tensor's read waits for nothing
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_device = torch.ones(3, device="cuda")
        assert host_sync.item(on_device.sum(), "test.norm", fake_value=1.5) == 1.5
        assert host_sync.tolist(on_device, "test.splits") == [0.0, 0.0, 0.0]
        host_sync.tolist(on_device, "test.splits")
    assert host_sync.counts() == {"test.norm": 1, "test.splits": 2}
    assert host_sync.total() == 3
    host_sync.reset()
    assert host_sync.counts() == {}
