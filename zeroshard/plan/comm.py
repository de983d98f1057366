"""Communication per optimizer step, and how long it takes on a given network.

Volumes follow the runtime (docs/runtime.md): stage 0 all-reduces the padded grads; stages 1-2
reduce-scatter them and all-gather the updated params; stage 3 all-gathers in forward and again in
backward (less the root, which stays gathered) and reduce-scatters. Hybrid layouts reduce-scatter
and all-gather inside the shard group and all-reduce the reduced shard across replicas. Per-rank
wire bytes use the ring cost: (n-1)/n of the buffer for a reduce-scatter or all-gather, twice
that for an all-reduce. A collective is as slow as its slowest link, so a group that spans nodes
runs at the inter-node bandwidth.
"""

from __future__ import annotations

import dataclasses

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    op: str
    group: str
    """``world`` (every data-parallel rank), ``shard`` (the ranks a buffer is sharded over),
    ``replicate`` (hybrid) or ``tp`` (the ranks one layer is split over)."""
    size: int
    """Ranks in the group."""
    buffer_bytes: int
    """Bytes of the full buffer (all-gather output, reduce-scatter input, all-reduce buffer)."""
    count: int = 1
    """Times per optimizer step."""
    spans_nodes: bool = False

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown collective {self.op!r}; use one of {', '.join(OPS)}")
        if self.size < 1 or self.buffer_bytes < 0 or self.count < 0:
            raise ValueError(f"collective {self.op} needs size >= 1 and non-negative bytes and count")

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends per step with a ring algorithm."""
        if self.size == 1:
            return 0
        factor = 2 if self.op == "all_reduce" else 1
        return int(factor * (self.size - 1) / self.size * self.buffer_bytes * self.count)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Network:
    """Link speeds in gigabits per second (what NICs and NVLink specs quote divided by 8 is GB/s)."""

    intra_gbps: float = 1600.0
    inter_gbps: float = 200.0
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if not (self.intra_gbps > 0 and self.inter_gbps > 0):
            raise ValueError(f"bandwidths must be positive Gb/s, got intra={self.intra_gbps} inter={self.inter_gbps}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive int, got {self.gpus_per_node!r}")

    def seconds(self, collectives: tuple[Collective, ...]) -> float:
        total = 0.0
        for c in collectives:
            gbps = self.inter_gbps if c.spans_nodes else self.intra_gbps
            total += c.wire_bytes / (gbps * 1e9 / 8)
        return total


def step_collectives(*, stage: int, world: int, shards: int, padded: int, root_padded: int, compute_bytes: int,
                     reduce_bytes: int, accum: int, accumulation: str, reshard_after_forward: bool,
                     gpus_per_node: int | None = None) -> tuple[Collective, ...]:
    """Collectives of one optimizer step. ``padded`` and ``root_padded`` are element counts."""
    replicas = world // shards
    gpn = gpus_per_node or world
    shard_group = "world" if shards == world else "shard"
    shard_spans = shards > gpn
    world_spans = world > gpn
    # Stages 0-1 keep full grads, so no_sync defers their reduction to the last micro-step; stages
    # 2-3 reduce every micro-step unless accumulation is "unsharded".
    reductions = accum if stage >= 2 and accumulation == "sharded" else 1
    grads = padded * reduce_bytes
    if stage == 0:
        return (Collective(op="all_reduce", group="world", size=world, buffer_bytes=grads, count=reductions,
                           spans_nodes=world_spans),)
    out = [Collective(op="reduce_scatter", group=shard_group, size=shards, buffer_bytes=grads, count=reductions,
                      spans_nodes=shard_spans)]
    if replicas > 1:
        out.append(Collective(op="all_reduce", group="replicate", size=replicas, buffer_bytes=grads // shards,
                              count=reductions, spans_nodes=world_spans))
    params = padded * compute_bytes
    if stage < 3:
        out.append(Collective(op="all_gather", group=shard_group, size=shards, buffer_bytes=params, count=1,
                              spans_nodes=shard_spans))
        return tuple(out)
    out.append(Collective(op="all_gather", group=shard_group, size=shards, buffer_bytes=params, count=accum,
                          spans_nodes=shard_spans))
    if reshard_after_forward:
        # The root stays gathered from its forward through backward: only the blocks re-gather.
        out.append(Collective(op="all_gather", group=shard_group, size=shards,
                              buffer_bytes=(padded - root_padded) * compute_bytes, count=accum, spans_nodes=shard_spans))
    return tuple(out)
