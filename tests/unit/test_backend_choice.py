"""--backend gloo|nccl, ZEROSHARD_BACKEND, and each local rank's device, with the GPU count mocked.

NCCL runs one rank per GPU: more local ranks than GPUs must be one line before any rank starts
(the CLI) or before any process group exists (zs.init under torchrun), not NCCL's "duplicate GPU"
or "invalid device ordinal" from inside a rank. gloo's CUDA tensors may share a GPU.
"""

from __future__ import annotations

import pytest
import torch

from zeroshard.comm import devices
from zeroshard.comm.devices import DeviceChoiceError, check_local_ranks, choose_backend, rank_device


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(devices, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(devices.BACKEND_ENV, raising=False)
    monkeypatch.delenv(devices.DEVICE_ENV, raising=False)


def test_backend_is_the_argument_then_the_environment_then_the_machine(two_gpus, monkeypatch):
    assert choose_backend() == "nccl"  # CUDA visible
    monkeypatch.setenv(devices.BACKEND_ENV, "gloo")
    assert choose_backend() == "gloo" and choose_backend("nccl") == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(devices.BACKEND_ENV)
    assert choose_backend() == "gloo"
    with pytest.raises(DeviceChoiceError, match="backend 'mpi' is not one of gloo, nccl; pass --backend gloo"):
        choose_backend("mpi")


def test_nccl_refuses_more_local_ranks_than_gpus(two_gpus):
    assert [rank_device("nccl", r, 2) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(DeviceChoiceError) as err:
        rank_device("nccl", 0, 3)
    assert str(err.value) == ("--nproc 3 on a 2-device NCCL mesh: NCCL runs one rank per GPU; use --nproc 2 or fewer "
                              "per host, or --backend gloo (ranks may share a GPU)")
    with pytest.raises(DeviceChoiceError, match="--nproc 3 on a 2-device"):
        rank_device("nccl", 2, 0)  # no LOCAL_WORLD_SIZE: local rank 2 needs a third GPU all the same
    with pytest.raises(DeviceChoiceError, match="needs CUDA devices and this process sees none"):
        check_local_ranks("nccl", 1, count=0)


def test_gloo_stays_on_the_cpu_unless_asked_and_its_cuda_ranks_share_gpus(two_gpus, monkeypatch):
    assert {rank_device("gloo", r, 3) for r in range(3)} == {torch.device("cpu")}
    check_local_ranks("gloo", 8)  # nothing to refuse
    monkeypatch.setenv(devices.DEVICE_ENV, "cuda")
    assert [rank_device("gloo", r, 3).index for r in range(3)] == [0, 1, 0]  # LOCAL_RANK mod the GPUs
    monkeypatch.setenv(devices.DEVICE_ENV, "tpu")
    with pytest.raises(DeviceChoiceError, match="ZEROSHARD_DEVICE='tpu' is not a device gloo runs on"):
        rank_device("gloo", 0, 1)


def test_zs_init_refuses_before_any_process_group(two_gpus, monkeypatch):
    import torch.distributed as dist

    import zeroshard as zs

    # An earlier test in this worker may have left its one-process world up; init would return it.
    zs.shutdown()
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(DeviceChoiceError, match="--nproc 3 on a 2-device NCCL mesh"):
        zs.init(backend="nccl")
    assert not dist.is_initialized()


def test_cli_refuses_nproc_3_on_a_two_gpu_nccl_mesh_in_one_line(two_gpus, capsys, monkeypatch):
    from zeroshard.cli.main import main

    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    argv = ["--model", "tiny", "--steps", "1", "--nproc", "3", "--batch", "6"]
    for command in ("train", "verify"):
        assert main([command, *argv, "--backend", "nccl"]) == 1
        err = capsys.readouterr().err
        assert err == (f"zeroshard {command}: error: --nproc 3 on a 2-device NCCL mesh: NCCL runs one rank per GPU; "
                       "use --nproc 2 or fewer per host, or --backend gloo (ranks may share a GPU)\n")
    monkeypatch.setenv(devices.BACKEND_ENV, "nccl")  # the default here, as on a torchrun host
    assert main(["train", *argv]) == 1 and "--nproc 3 on a 2-device NCCL mesh" in capsys.readouterr().err


def test_backend_is_a_flag_and_a_toml_key(tmp_path):
    from zeroshard.trainer.config import TrainConfig, config_from_sources

    toml = tmp_path / "run.toml"
    toml.write_text('backend = "gloo"\n')
    assert config_from_sources(toml, {}).backend == "gloo"
    assert config_from_sources(toml, {"backend": "nccl"}).backend == "nccl"
    assert TrainConfig().backend is None
    with pytest.raises(ValueError, match="backend='mpi' is invalid; use gloo or nccl"):
        TrainConfig(backend="mpi")
