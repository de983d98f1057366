"""The planner's word on where a run's groups sit: the figures behind two topology messages.

- A shard group that spans hosts while a host-sized hybrid layout (shard inside each host,
  replicate across) fits one device: ``shard_group_advice`` names the ``--shard-size`` and the
  planner's per-rank total for it, so the advice and ``zeroshard plan`` cannot disagree.
- A tp group refused for spanning hosts (zeroshard/comm/topology.py): ``cross_host_tp_cost`` prices
  its per-layer all-reduces on the host network against the intra-host links.

Both take the topology as ``Topology.describe`` writes it (summary.json, metrics.jsonl's header).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from zeroshard.comm.names import Dim
from zeroshard.comm.topology import Topology
from zeroshard.tools.planner.api import plan
from zeroshard.tools.planner.result import Plan
from zeroshard.tools.planner.spec import STAGE_NAMES, trainer_clip


@dataclasses.dataclass(frozen=True)
class ShardAdvice:
    shard_size: int
    layout: str
    """The planner's layout name for it (zero3_hybrid, ...)."""
    need_bytes: int
    """The planner's per-rank total for that layout."""
    budget_bytes: int
    """What one rank has: a CUDA device's memory, or the host's RAM shared by its ranks."""
    text: str


def topology_of(summary: Mapping[str, Any]) -> Topology:
    return Topology.from_hosts(summary["rank_hosts"])


def _sizes(summary: Mapping[str, Any]) -> dict[Dim, int]:
    return {Dim(k): int(v) for k, v in summary["dims"].items()}


def rank_budget(summary: Mapping[str, Any]) -> int:
    """Bytes one rank may use, from the first host's facts: a GPU's own memory, or on a CPU run the
    host's RAM divided among the ranks that share it."""
    facts = next(iter(summary["facts"].values()))
    memory = int(facts.get("memory_bytes") or 0)
    if str(facts.get("device", "cpu")).startswith("cuda"):
        return memory
    return memory // max(1, int(summary.get("ranks_per_host") or 1))


def plan_run(model: Any, train: Mapping[str, Any], *, world: int, shard_size: int | None, gpus_per_node: int,
             device: str) -> Plan:
    """``zs.plan`` for a ``zeroshard train`` run's settings (``train`` is ``TrainConfig.to_dict()``)."""
    # The engine's knobs with zs.plan's defaults: a config written before a knob existed lacks it.
    return plan(model, world=world, stage=train["stage"], mp=train.get("mp"), batch=train["batch"],
                seq=train["seq_len"], accum=train.get("accum", 1), clip=train.get("clip"),
                checkpointing=train.get("checkpointing", "none"), shard_size=shard_size, prefetch=train.get("prefetch", 1),
                reshard_after_forward=train.get("reshard_after_forward", True), bucket_mb=train.get("bucket_mb", 25.0),
                device=device, gpus_per_node=gpus_per_node, tp=train.get("tp", 1))


def shard_group_advice(model: Any, train: Mapping[str, Any], summary: Mapping[str, Any]) -> ShardAdvice | None:
    """The advice when the run's shard group spans hosts and the host-sized hybrid layout fits;
    None otherwise (stage 0 has no shard group; offload runs are sized by the offload planner)."""
    if train["stage"] == 0 or train.get("offload", "none") != "none" or summary.get("ranks_per_host") is None:
        return None
    topology, sizes = topology_of(summary), _sizes(summary)
    shard = topology.host_sized_shard(sizes)
    if shard is None:
        return None
    device = "cuda" if str(next(iter(summary["facts"].values())).get("device", "cpu")).startswith("cuda") else "cpu"
    p = plan_run(model, train, world=topology.world, shard_size=shard, gpus_per_node=topology.ranks_per_host,
                 device=device)
    layout = f"{STAGE_NAMES[train['stage']]}_hybrid"
    need, budget = p[layout].device.total, rank_budget(summary)
    if budget <= 0 or need > budget:
        return None
    text = (f"the shard group spans hosts ({summary['shape']}, shard {sizes[Dim.SHARD]}): --shard-size {shard} "
            f"shards inside each host and replicates across them, and fits: the planner puts {layout} at "
            f"{need / 1e6:,.2f} MB per rank against {budget / 1e6:,.0f} MB available "
            f"(`{plan_command(model, train, world=topology.world, shard_size=shard, device=device)}`)")
    return ShardAdvice(shard_size=shard, layout=layout, need_bytes=need, budget_bytes=budget, text=text)


def plan_command(model: Any, train: Mapping[str, Any], *, world: int, shard_size: int, device: str) -> str:
    """The ``zeroshard plan`` command line that prints the same figures as ``plan_run``."""
    args = [f"--model {train['model']}", f"--world {world}", f"--stage {train['stage']}", f"--batch {train['batch']}",
            f"--seq {train['seq_len']}", f"--mp {train.get('mp', 'fp32')}", f"--vocab-size {model.vocab_size}",
            f"--shard-size {shard_size}", f"--device {device}"]
    optional = {"tp": 1, "accum": 1, "checkpointing": "none", "prefetch": 1, "bucket_mb": 25.0}
    args += [f"--{k.replace('_', '-')} {train[k]}" for k, default in optional.items() if train.get(k, default) != default]
    if train.get("clip", trainer_clip()) != trainer_clip():  # clipping's chunk is in the step's peak
        args.append(f"--clip {train['clip']}")
    return "zeroshard plan memory " + " ".join(args)


def cross_host_tp_cost(model: Any, train: Mapping[str, Any], *, world: int, ranks_per_host: int,
                       hw: Any = None) -> str:
    """"tp's all-reduces move X MB per rank per step: ~A ms across hosts against ~B ms inside one", on
    ``zeroshard plan``'s default hardware (or ``hw``), priced by the simulator's link model."""
    from zeroshard.tools.sim.hardware import DEFAULT_HW, PRESETS
    from zeroshard.tools.sim.network import rows_seconds

    hw = hw or PRESETS[DEFAULT_HW]
    p = plan_run(model, train, world=world, shard_size=None, gpus_per_node=ranks_per_host, device="cuda")
    rows = tuple(c for c in p[STAGE_NAMES[train["stage"]]].collectives if c.group == "tp")
    inside = tuple(dataclasses.replace(c, spans_nodes=False) for c in rows)
    across = tuple(dataclasses.replace(c, spans_nodes=True) for c in rows)
    moved = sum(c.wire_bytes for c in rows)
    return (f"modelled cost: tp's collectives move {moved / 1e6:,.1f} MB per rank per step, "
            f"~{rows_seconds(across, hw) * 1e3:,.2f} ms on the host network ({hw.inter_bandwidth * 8 / 1e9:g} Gb/s) "
            f"against ~{rows_seconds(inside, hw) * 1e3:,.2f} ms inside a host ({hw.intra_bandwidth * 8 / 1e9:g} Gb/s)")
