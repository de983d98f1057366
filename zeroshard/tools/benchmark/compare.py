"""Run every candidate on the same work, interleaved, and summarise.

Runs alternate A B C ... A B C ... so slow drift of this shared machine hits everyone alike.
Timing is wall time per step after a barrier. Peak live tensor bytes (everything alive: params,
grads, optimizer state, activations, buffers) come from torch's MemTracker over one separate step,
so measuring memory never overlaps timing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
import statistics

import torch

from zeroshard.comm import get_ledger as ledger
from zeroshard.comm.world import init
from zeroshard.runtime import CommQuant
from zeroshard.tools.benchmark import candidates as c
from zeroshard.models import GPTConfig
from zeroshard.tools.harness import timed
from zeroshard.runtime.precision import parse_dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSpec:
    model: str = "small"
    world: int = 2
    batch: int = 4
    """Sequences per rank per step."""
    seq: int = 128
    dtype: str = "fp32"
    rounds: int = 5
    steps_per_round: int = 3
    warmup: int = 2
    seed: int = 0
    layers: int | None = None
    """Blocks, replacing the preset's (a thin, deep model is where per-unit overheads show)."""
    width: int | None = None
    """Embedding width, replacing the preset's; a multiple of the preset's head count."""
    host_breakdown: bool = False
    """Instead of the comparison: the runtime's host time per kind of work and per unit, each of
    our stages (``only`` picks them), zeroshard/tools/benchmark/host.py."""
    only: tuple[str, ...] = ()
    """Run names to keep (floor, stage0..stage3, stage3-quant, ddp, fsdp2, fsdp2-noreshard); empty keeps all
    but stage3-quant. The ratio
    columns need the floor, FSDP2 and torch DDP rows, so those always run."""


RUN_KEYS = ("floor", "stage0", "stage1", "stage2", "stage3", "stage3-quant", "ddp", "fsdp2", "fsdp2-noreshard")
# stage3-quant: stage 3 with int8 weight all-gather and grad reduction (qwZ+qgZ); runs only when asked.
_ON_REQUEST = ("stage3-quant",)
_ALWAYS = ("floor", "ddp", "fsdp2")


def _candidates(spec: BenchSpec, cfg: GPTConfig):
    dtype = parse_dtype(spec.dtype)
    if dtype is None:
        raise ValueError(f"bench dtype must be fp32, bf16 or fp16, got {spec.dtype!r}")
    unknown = set(spec.only) - set(RUN_KEYS)
    if unknown:
        raise ValueError(f"unknown bench runs {sorted(unknown)}; choose from {', '.join(RUN_KEYS)}")
    makers = {"floor": lambda: c.floor(cfg, spec.seed, dtype),
              **{f"stage{s}": functools.partial(c.ours, cfg, spec.seed, dtype, s) for s in (0, 1, 2, 3)},
              "stage3-quant": lambda: c.ours(cfg, spec.seed, dtype, 3, CommQuant(weights=True, grads=True)),
              "ddp": lambda: c.torch_ddp(cfg, spec.seed, dtype),
              "fsdp2": lambda: c.fsdp2(cfg, spec.seed, dtype, True),
              "fsdp2-noreshard": lambda: c.fsdp2(cfg, spec.seed, dtype, False)}
    for key in RUN_KEYS:
        if key in spec.only or key in _ALWAYS or not (spec.only or key in _ON_REQUEST):
            yield makers[key]


def _peak_live_bytes(candidate, x, y, device) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(candidate.model, candidate.optimizer)
    with tracker:
        candidate.step(x, y)
    snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
    return int(next(v for k, v in snapshot.items() if str(k) == "Total"))


def _workload(spec: BenchSpec, mesh) -> tuple[GPTConfig, torch.Tensor, torch.Tensor]:
    shape = {k: v for k, v in (("n_layer", spec.layers), ("n_embd", spec.width)) if v is not None}
    cfg = GPTConfig.named(spec.model, seq_len=spec.seq, **shape)
    gen = torch.Generator().manual_seed(spec.seed + mesh.rank)
    x = torch.randint(0, cfg.vocab_size, (spec.batch, spec.seq), generator=gen).to(mesh.device)
    y = torch.randint(0, cfg.vocab_size, (spec.batch, spec.seq), generator=gen).to(mesh.device)
    return cfg, x, y


def host_rank(spec: BenchSpec) -> dict:
    """Spawn target of ``--host-breakdown``: each asked stage's host clock table on this rank."""
    from zeroshard.models import GPT
    from zeroshard.tools.benchmark.host import measure

    mesh = init()
    torch.set_num_threads(1)
    cfg, x, y = _workload(spec, mesh)
    stages = [int(k[len("stage"):]) for k in spec.only if k[len("stage"):].isdigit()] or [0, 1, 2, 3]
    out = {}
    for stage in stages:
        torch.manual_seed(spec.seed)
        model = GPT(cfg).to(mesh.device)
        out[f"zeroshard stage {stage}"] = measure(model, x, y, stage=stage, steps=spec.rounds * spec.steps_per_round,
                                                  warmup=spec.warmup)
    return out


def run_host_breakdown(spec: BenchSpec) -> dict[str, list[dict]]:
    """Per stage, the rows of ``host.rows`` (mean over ranks)."""
    from zeroshard.tools.benchmark.host import rows
    from zeroshard.trainer.launch import spawn

    per_rank = spawn(host_rank, spec.world, args=(spec,), timeout_s=3600)
    return {name: rows([r[name] for r in per_rank]) for name in per_rank[0]}


def rank_main(spec: BenchSpec) -> dict:
    mesh = init()
    torch.set_num_threads(1)
    cfg, x, y = _workload(spec, mesh)
    built = [make() for make in _candidates(spec, cfg)]
    rows: dict[str, dict[str, Any]] = {}
    for cand in built:
        for _ in range(spec.warmup):
            cand.step(x, y)
        ledger_before = ledger().total_bytes()
        peak = _peak_live_bytes(cand, x, y, mesh.device)
        comm = ledger().total_bytes() - ledger_before if cand.ours else None
        rows[cand.name] = {"times": [], "peak_bytes": peak, "comm_bytes": comm}
    for _ in range(spec.rounds):
        for cand in built:
            rows[cand.name]["times"] += timed(functools.partial(cand.step, x, y), spec.steps_per_round, phase="bench",
                                              device=x.device)
    tokens = spec.batch * spec.seq * mesh.world
    out = {}
    for name, row in rows.items():
        median = statistics.median(row["times"])
        out[name] = {"median_step_s": median, "tokens_per_s": tokens / median, "peak_bytes": row["peak_bytes"],
                     "comm_bytes": row["comm_bytes"], "steps": len(row["times"])}
    return out


def run_bench(spec: BenchSpec) -> list[dict]:
    from zeroshard.trainer.launch import spawn

    per_rank = spawn(rank_main, spec.world, args=(spec,), timeout_s=3600)
    names = list(per_rank[0])
    rows = []
    for name in names:
        # A step is as slow as its slowest rank; memory is reported for the worst rank.
        step = max(r[name]["median_step_s"] for r in per_rank)
        rows.append({"name": name, "median_step_s": step,
                     "tokens_per_s": spec.batch * spec.seq * spec.world / step,
                     "peak_bytes_per_rank": max(r[name]["peak_bytes"] for r in per_rank),
                     "comm_bytes_per_step": per_rank[0][name]["comm_bytes"]})
    by = {r["name"]: r for r in rows}
    for row in rows:
        row["x_floor"] = row["median_step_s"] / by["floor (1 process)"]["median_step_s"]
        row["vs_fsdp2"] = row["tokens_per_s"] / by["FSDP2"]["tokens_per_s"]
        row["vs_torch_ddp"] = row["tokens_per_s"] / by["torch DDP"]["tokens_per_s"]
    return rows
