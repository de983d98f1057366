"""Where offloaded tensors live: pinned host memory, or memory-mapped files.

[Note: disk offload files]
Each store writes into its own directory ``<dir>/zeroshard-offload-<pid>-r<rank>-<n>@<host>``. The
directory is removed at a clean exit (``close`` or interpreter shutdown). A crashed process leaves
its directory behind, but nothing ever reads another process's files: a new run creates its own
directory and removes leftovers whose process is no longer alive, so stale files cannot corrupt
it. Files are created sparse and filled from memory; their contents are never trusted across runs.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import shutil
import socket
import tempfile
import weakref
from pathlib import Path

import torch

_PREFIX = "zeroshard-offload-"
_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MS_SYNC = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


class HostStore:
    """fp32 masters and optimizer state in host memory, pinned when the compute device is not
    the CPU so device<->host copies can run asynchronously."""

    kind = "cpu"

    def __init__(self, compute_device: torch.device) -> None:
        self.compute_device = compute_device
        self.pin = compute_device.type != "cpu"

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(numel, dtype=dtype)
        return out.pin_memory() if self.pin else out

    def adopt(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Move an existing tensor (optimizer state) into the store."""
        return tensor if tensor.device.type == "cpu" else tensor.to("cpu")

    def prefetch(self, tensors) -> None:
        pass

    def release(self, tensors) -> None:
        pass

    def return_freed_memory(self) -> None:
        """Hand freed heap memory back to the OS (glibc keeps it by default), so moving state out
        of RAM actually lowers resident memory."""
        trim = getattr(_libc, "malloc_trim", None)
        if trim is not None:
            trim(ctypes.c_size_t(0))

    def close(self) -> None:
        pass


class DiskStore(HostStore):
    """Tensors backed by memory-mapped files: the kernel pages them in on use; ``release`` writes
    them back and drops them from this process's resident memory, ``prefetch`` asks for them early."""

    kind = "disk"

    def __init__(self, compute_device: torch.device, directory: str, rank: int) -> None:
        super().__init__(compute_device)
        base = Path(directory)
        base.mkdir(parents=True, exist_ok=True)
        _remove_dead_leftovers(base)
        self.directory = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-r{rank}-",
                                               suffix=f"@{socket.gethostname()}", dir=base))
        self._count = 0
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.directory), True)
        atexit.register(self._finalizer)

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self._count += 1
        path = self.directory / f"{self._count:05d}-{name.replace('/', '_').replace('<', '').replace('>', '')}.bin"
        nbytes = max(1, numel) * torch.empty(0, dtype=dtype).element_size()
        with open(path, "wb") as handle:
            handle.truncate(nbytes)  # sparse: reads as zeros, takes disk only when written
        return torch.from_file(str(path), shared=True, size=max(1, numel), dtype=dtype)[:numel]

    def adopt(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        mapped = self.allocate(name, tensor.numel(), tensor.dtype).view(tensor.shape)
        mapped.copy_(tensor)
        return mapped

    def prefetch(self, tensors) -> None:
        for t in tensors:
            _madvise(t, _MADV_WILLNEED)

    def release(self, tensors) -> None:
        for t in tensors:
            _msync(t)
            _madvise(t, _MADV_DONTNEED)

    def close(self) -> None:
        self._finalizer()


def _page_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    aligned = start - start % _PAGE
    return aligned, end - aligned


def _madvise(t: torch.Tensor, advice: int) -> None:
    if t.numel() == 0:
        return
    addr, length = _page_range(t)
    _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(advice))


def _msync(t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    addr, length = _page_range(t)
    _libc.msync(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(_MS_SYNC))


def _remove_dead_leftovers(base: Path) -> None:
    host = socket.gethostname()
    for entry in base.glob(f"{_PREFIX}*@{host}"):
        try:
            pid = int(entry.name[len(_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_store(policy, compute_device: torch.device, rank: int):
    policy.require_directory()
    if policy.kind == "cpu":
        return HostStore(compute_device)
    if policy.kind == "disk":
        return DiskStore(compute_device, policy.directory, rank)
    return None
