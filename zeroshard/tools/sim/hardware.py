"""Node presets (peak compute, HBM, links) and a TOML loader for your own.

Link figures are per GPU and per direction, as nccl-tests' bus bandwidth reports them
(nccl-tests doc/PERFORMANCE.md): a collective's bus bandwidth approaches this figure at large sizes.
Latencies (alpha) are per ring step; they are order-of-magnitude assumptions in the range NCCL's own
tuning model uses (a few microseconds on NVLink, more across the network), not measurements.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from zeroshard.tools.sim.measured import MeasuredCompute, MeasuredConcurrency, MeasuredLink


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s per GPU (no sparsity)."""
    hbm_bytes: float
    hbm_bandwidth: float
    """Bytes/s; memory-bound work (elementwise ops, the optimizer) runs at this."""
    gpus_per_node: int = 8
    intra_bandwidth: float
    """NVLink bytes/s per GPU per direction."""
    inter_bandwidth: float
    """Network bytes/s per GPU per direction (one NIC per GPU, rail-optimised)."""
    intra_latency: float = 3e-6
    inter_latency: float = 10e-6
    gemm_efficiency: float = 0.6
    """Fraction of peak that large bf16 GEMMs reach. Assumption: measured large-GEMM throughput on
    H100 SXM is commonly 600-700 TFLOP/s of the 989 peak; we take the lower end."""
    attention_efficiency: float = 0.35
    """Fraction of peak for FlashAttention-2 (FlashAttention-3 paper, Shah et al. 2024: FA2 reaches
    about 35% of H100 peak)."""
    links: tuple[MeasuredLink, ...] = ()
    """Fitted alpha-beta per collective and group size (``zeroshard plan calibrate``); where one
    exists for a collective it replaces the intra-node link model for it."""
    compute: tuple[MeasuredCompute, ...] = ()
    """Measured seconds per unit; where one exists the FLOP model is not used for that model."""
    concurrency: tuple[MeasuredConcurrency, ...] = ()
    """How collectives in flight at once share the backend, per world size (``plan calibrate``).
    Without it each process group's collectives run one at a time in launch order, as on one NCCL
    stream; with it every collective in flight shares one pool (gloo's threads on a CPU host)."""
    contention: float = 0.0
    """Seconds compute is slowed per second of communication running under it: 0 on a GPU (copy
    engines, NCCL's own SMs aside); measured per collective (``MeasuredCompute``) on a CPU host,
    where gloo's threads and the ranks' compute share the same cores and can exceed 1."""
    host_link_bandwidth: float = 0.0
    """Bytes/s per GPU per direction between its memory and the host's (PCIe): offload's grad
    copies out and master copies back. 0: not known (offload cannot be simulated)."""
    host_memory_bandwidth: float = 0.0
    """Host DRAM bytes/s per GPU (the node's total over its GPUs): offload's optimizer step runs on
    the CPU, memory-bound, at this. 0: not known."""
    disk_bandwidth: float = 0.0
    """Bytes/s per GPU of the drives disk offload's files live on. 0: not known."""

    def __post_init__(self) -> None:
        for f in ("peak_flops", "hbm_bytes", "hbm_bandwidth", "intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware {self.name!r}: {f} must be positive, got {getattr(self, f)!r}")
        for f in ("gemm_efficiency", "attention_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"hardware {self.name!r}: {f} must be in (0, 1], got {getattr(self, f)!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name!r}: gpus_per_node must be a positive int")
        if not self.contention >= 0:
            raise ValueError(f"hardware {self.name!r}: contention must be >= 0, got {self.contention!r}")
        for f in ("host_link_bandwidth", "host_memory_bandwidth", "disk_bandwidth"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"hardware {self.name!r}: {f} must be >= 0 (0: not known), got {getattr(self, f)!r}")

    def offload_figure(self, field: str, offload: str) -> float:
        """A host figure offload needs, or a one-line error naming the TOML key to set."""
        value = float(getattr(self, field))
        if not value > 0:
            raise ValueError(f"offload={offload} needs hardware {self.name!r} to give {field} (bytes/s per GPU); "
                             f"set it in the hardware TOML, or start from a preset with base = \"h100\"")
        return value


_GB = 1e9
# Host side of an 8-GPU node, for offload. The GPU's host link is PCIe x16 at the datasheet's rate
# (H100/H200 SXM: Gen5, 128 GB/s bidirectional, 64 per direction; A100 SXM4: Gen4, 64 bidirectional),
# of which we take about 80% as achieved, a typical pinned-copy figure. Host DRAM: DGX H100 has two
# Xeon 8480C sockets of 8 DDR5-4800 channels (2 x 307 GB/s), DGX A100 two EPYC 7742 of 8 DDR4-3200
# channels (2 x 205 GB/s), shared by 8 GPUs. Disk: an assumption, not a datasheet figure: one
# datacentre NVMe drive's sequential write (about 3.5 GB/s for PCIe Gen4 U.2 drives) per GPU on
# the H100/H200 nodes (DGX H100: 8 x 3.84 TB U.2), half of that on DGX A100 (4 drives).
_HOPPER_HOST: dict[str, Any] = dict(host_link_bandwidth=50 * _GB, host_memory_bandwidth=614 * _GB / 8, disk_bandwidth=3.5 * _GB)
_AMPERE_HOST: dict[str, Any] = dict(host_link_bandwidth=25 * _GB, host_memory_bandwidth=410 * _GB / 8, disk_bandwidth=1.75 * _GB)
PRESETS: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16 (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s,
    # NVLink 4 at 900 GB/s bidirectional (450 per direction). DGX H100: one 400 Gb/s ConnectX-7 per GPU.
    "h100": Hardware(name="h100", peak_flops=989e12, hbm_bytes=80 * _GB, hbm_bandwidth=3.35e12,
                     intra_bandwidth=450 * _GB, inter_bandwidth=50 * _GB, **_HOPPER_HOST),
    # The H100 torchtitan benchmarks on (docs/performance.md, Grand Teton): 96 GB HBM2e at 2.4 TB/s,
    # 400 Gb/s RDMA per GPU, 500 W power limit (not modelled: peak is left at the datasheet figure).
    "h100-96": Hardware(name="h100-96", peak_flops=989e12, hbm_bytes=96 * _GB, hbm_bandwidth=2.4e12,
                        intra_bandwidth=450 * _GB, inter_bandwidth=50 * _GB, **_HOPPER_HOST),
    # NVIDIA H200 SXM datasheet: same compute as H100, 141 GB HBM3e at 4.8 TB/s; same NVLink 4 and NICs.
    "h200": Hardware(name="h200", peak_flops=989e12, hbm_bytes=141 * _GB, hbm_bandwidth=4.8e12,
                     intra_bandwidth=450 * _GB, inter_bandwidth=50 * _GB, **_HOPPER_HOST),
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s bf16, 2.039 TB/s; NVLink 3 at 600 GB/s bidirectional;
    # DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU.
    "a100": Hardware(name="a100", peak_flops=312e12, hbm_bytes=80 * _GB, hbm_bandwidth=2.039e12,
                     intra_bandwidth=300 * _GB, inter_bandwidth=25 * _GB, **_AMPERE_HOST),
}


DEFAULT_HW = "h100"
"""What ``plan`` prices and simulates on when no --hw is given."""


def with_links(hw: Hardware, *, intra_gbps: float | None = None, inter_gbps: float | None = None,
               gpus_per_node: int | None = None) -> Hardware:
    """``hw`` with the links a user gave in gigabits per second (what NIC and NVLink specs quote;
    divided by 8 it is the bytes/s this model keeps) and its node size; what is None stays ``hw``'s."""
    given: dict[str, Any] = {}
    for field, gbps in (("intra_bandwidth", intra_gbps), ("inter_bandwidth", inter_gbps)):
        if gbps is not None:
            if not gbps > 0:
                raise ValueError(f"--{field.split('_')[0]}-gbps must be a positive Gb/s figure, got {gbps}")
            given[field] = gbps * 1e9 / 8
    if gpus_per_node is not None:
        given["gpus_per_node"] = gpus_per_node
    return dataclasses.replace(hw, **given) if given else hw


def load_hardware(name_or_path: str) -> Hardware:
    """A preset by name, or a TOML file whose top-level keys are ``Hardware`` fields.

    A TOML file may set ``base = "h100"`` to start from a preset and override some fields.
    """
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.suffix == ".toml":
        raise ValueError(f"unknown hardware {name_or_path!r}; use one of {', '.join(PRESETS)} or a .toml file")
    if not path.is_file():
        raise ValueError(f"hardware file {path} does not exist; pass an existing .toml or a preset name")
    with path.open("rb") as f:
        table = tomllib.load(f)
    base = table.pop("base", None)
    table.pop("topology", None)  # where plan calibrate measured: zeroshard/tools/planner/topology_source.py reads it
    try:  # arrays of tables become the measured entries
        for key, cls in (("links", MeasuredLink), ("compute", MeasuredCompute),
                         ("concurrency", MeasuredConcurrency)):
            if key in table:
                table[key] = tuple(cls(**entry) for entry in table[key])
    except TypeError as e:
        raise ValueError(f"{path}: a [[links]], [[compute]] or [[concurrency]] entry is malformed: {e}") from None
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = set(table) - fields
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(fields))}")
    if base is not None:
        if base not in PRESETS:
            raise ValueError(f"{path}: base {base!r} is not a preset; use one of {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[base], **{"name": path.stem, **table})
    try:
        return Hardware(**{"name": path.stem, **table})
    except TypeError as e:
        raise ValueError(f"{path}: {e}; set every field or give base = \"h100\"") from None
