"""This rank's own facts for the topology (zeroshard/comm/topology.py): host, device and links.

Everything here is local and cheap (environment, /sys, /proc, one ``nvidia-smi topo -m`` with a
timeout when it exists); nothing talks to other ranks. Reading a fact may fail on an odd machine:
it is then left empty rather than failing the run, since the facts describe the run and only the
host name decides anything.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import torch

from zeroshard.comm.topology import RankFacts

HOST_ENV = "ZEROSHARD_HOST"
"""Overrides the host name a rank reports: for containers that share one hostname across machines,
or to lay a one-machine run out as several hosts."""

NCCL_INTERFACE_VARS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_NET", "NCCL_P2P_DISABLE",
                       "NCCL_P2P_LEVEL", "NCCL_CROSS_NIC")
_NVIDIA_SMI_TIMEOUT_S = 5.0


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def local_facts(rank: int, device: torch.device) -> RankFacts:
    """What this rank reports at ``zs.init``."""
    cuda = device.type == "cuda"
    iface, address = _backend_interface(cuda)
    return RankFacts(
        rank=rank,
        host=host_name(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if cuda else _cpu_model(),
        device_count=torch.cuda.device_count() if cuda else 0,
        links=_cuda_links() if cuda else "",
        socket=None if cuda else _cpu_socket(),
        sockets=None if cuda else _socket_count(),
        interface=iface,
        address=address,
        nccl_env=tuple((k, os.environ[k]) for k in NCCL_INTERFACE_VARS if k in os.environ),
        memory_bytes=torch.cuda.get_device_properties(device).total_memory if cuda else _host_memory(),
    )


def _backend_interface(cuda: bool) -> tuple[str, str]:
    """(interface, address) the backend's sockets use: the named interface when the variable is set,
    else the address the hostname resolves to (what gloo binds to by default)."""
    name = os.environ.get("NCCL_SOCKET_IFNAME" if cuda else "GLOO_SOCKET_IFNAME", "")
    if name:
        return name, _interface_address(name.split(",")[0].lstrip("^="))
    try:
        return "", socket.gethostbyname(socket.gethostname())
    except OSError:
        return "", ""


def _interface_address(name: str) -> str:
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _first_cpu() -> int | None:
    try:
        return min(os.sched_getaffinity(0))
    except (AttributeError, OSError, ValueError):
        return None


def _cpu_socket() -> int | None:
    cpu = _first_cpu()
    if cpu is None:
        return None
    try:
        return int(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id").read_text())
    except (OSError, ValueError):
        return None


def _socket_count() -> int | None:
    ids = set()
    for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/physical_package_id"):
        try:
            ids.add(int(path.read_text()))
        except (OSError, ValueError):
            continue
    return len(ids) or None


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _cuda_links() -> str:
    """How this host's GPUs connect: from ``nvidia-smi topo -m`` when it is there, else torch's peer
    access ("p2p" or "no p2p" between device 0 and 1)."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                 timeout=_NVIDIA_SMI_TIMEOUT_S).stdout
            return summarize_topo_matrix(out)
        except (OSError, subprocess.TimeoutExpired):
            pass
    if torch.cuda.device_count() < 2:
        return "single GPU"
    return "p2p" if torch.cuda.can_device_access_peer(0, 1) else "no p2p"


def summarize_topo_matrix(text: str) -> str:
    """"NVLink (NV18)" or "PCIe (PIX, PHB)" from ``nvidia-smi topo -m``'s GPU-to-GPU cells."""
    kinds: set[str] = set()
    rows = [line.split() for line in text.splitlines() if line.startswith("GPU")]
    count = len(rows)
    for row in rows:
        kinds.update(cell for cell in row[1:count + 1] if cell != "X")
    if not kinds:
        return "single GPU" if count == 1 else ""
    nvlink = sorted(k for k in kinds if k.startswith("NV"))
    return f"NVLink ({', '.join(nvlink)})" if nvlink else f"PCIe ({', '.join(sorted(kinds))})"
