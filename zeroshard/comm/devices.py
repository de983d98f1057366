"""Which backend a run uses and which device each local rank's tensors live on.

The backend is ``zs.init(backend=)``, else ``ZEROSHARD_BACKEND`` (how a torchrun job picks one: the
ranks are not started by zeroshard), else NCCL where CUDA is visible and gloo elsewhere.

NCCL puts one rank on each GPU: two ranks on one device fail inside NCCL ("duplicate GPU"), and a
local rank past the last device fails at ``set_device`` ("invalid device ordinal"). So more local
ranks than devices is refused here, by name, before any group exists. gloo's tensors are on the
CPU unless ``ZEROSHARD_DEVICE=cuda`` asks for CUDA ones; gloo moves them through the host itself, so
several ranks may share a GPU and the local rank wraps around the devices.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("gloo", "nccl")
BACKEND_ENV = "ZEROSHARD_BACKEND"
"""The backend for ranks zeroshard does not start itself (torchrun): gloo or nccl."""
DEVICE_ENV = "ZEROSHARD_DEVICE"
"""Where gloo's tensors live: cpu (the default) or cuda. NCCL's are always on the rank's GPU."""


class DeviceChoiceError(ValueError):
    """A backend or device the machine cannot give; the message names the fix."""


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def choose_backend(backend: str | None = None) -> str:
    """``backend``, else ``ZEROSHARD_BACKEND``, else the machine's default (NCCL with CUDA, gloo without)."""
    name = backend or os.environ.get(BACKEND_ENV) or default_backend()
    if name not in BACKENDS:
        raise DeviceChoiceError(f"backend {name!r} is not one of {', '.join(BACKENDS)}; pass --backend gloo or "
                                f"--backend nccl (or set {BACKEND_ENV})")
    return name


def device_count() -> int:
    """CUDA devices this process sees (a test mocks it)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_local_ranks(backend: str, local_ranks: int, count: int | None = None) -> None:
    """Refuse ``local_ranks`` ranks on one host where NCCL would need more GPUs than there are."""
    if backend != "nccl":
        return
    count = device_count() if count is None else count
    if count == 0:
        raise DeviceChoiceError("--backend nccl needs CUDA devices and this process sees none; use --backend gloo")
    if local_ranks > count:
        raise DeviceChoiceError(f"--nproc {local_ranks} on a {count}-device NCCL mesh: NCCL runs one rank per GPU; "
                                f"use --nproc {count} or fewer per host, or --backend gloo (ranks may share a GPU)")


def rank_device(backend: str, local_rank: int, local_ranks: int, kind: str | None = None) -> torch.device:
    """The device of the rank ``local_rank`` of ``local_ranks`` on its host. ``kind``: where gloo's
    tensors live (default ``ZEROSHARD_DEVICE``, else cpu)."""
    if backend == "nccl":
        check_local_ranks(backend, max(local_ranks, local_rank + 1))
        return torch.device("cuda", local_rank)
    kind = kind or os.environ.get(DEVICE_ENV) or "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise DeviceChoiceError(f"{DEVICE_ENV}={kind!r} is not a device gloo runs on; use cpu or cuda")
    count = device_count()
    if count == 0:
        raise DeviceChoiceError(f"{DEVICE_ENV}=cuda needs CUDA devices and this process sees none; unset it to run "
                                "gloo on the CPU")
    return torch.device("cuda", local_rank % count)  # gloo copies through the host: ranks may share a GPU


_BACKEND_DEVICES: dict[str, str] = {}
"""Backends whose groups run on a device other than the usual one (nccl: cuda, else cpu), as
``declare_backend_device`` set them."""


def declare_backend_device(backend: str, device_type: str) -> None:
    """Say that groups of ``backend`` run on ``device_type`` (device index 0): the mesh's ``device``,
    which every collective's tensors must be on (zeroshard/comm/collectives.py). For a backend that
    holds no device of its own, such as torch's fake process group in the fake-GPU tests."""
    _BACKEND_DEVICES[backend] = device_type


def local_rank_device(backend: str) -> torch.device:
    """This process's device from torchrun's (or spawn's) LOCAL_RANK and LOCAL_WORLD_SIZE; a CUDA
    device becomes the current one. A backend given a device by ``declare_backend_device`` runs there."""
    if backend in _BACKEND_DEVICES:
        return torch.device(_BACKEND_DEVICES[backend], 0)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or local_rank + 1
    device = rank_device(backend, local_rank, local_ranks)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
