"""The recommender with pipeline parallelism as a candidate: `plan --pp N --device-mem SIZE`.

Across nodes, ZeRO-3 gathers every block over the inter-node links once per microbatch and pass,
while a pipeline keeps each stage's ZeRO inside a node and sends only activations between nodes,
at the price of the bubble. Neither wins everywhere, so both are priced on the same run (the same
model, world and global batch per step):

- memory per rank: ``zs.plan`` without a pipeline, ``plan_pipeline`` (the worst pp rank) with one;
- step time: the step replay (zeroshard/tools/sim/step.py) without, the pipeline replay
  (zeroshard/tools/sim/pipeline.py, bubble included) with one.

The candidates are no pipeline and every pp up to the one asked for that divides the model's
blocks (times the stages per rank) and the world, each with DDP and ZeRO 1-3 inside its stages.
The pick is the fastest that fits; a tie (within 1%) goes to no pipeline, then the lower ZeRO stage.
The answer carries ZeRO-3's row at every pp (memory, time), whichever wins.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroshard.tools import search
from zeroshard.tools.planner.recommend import gb
from zeroshard.tools.planner.spec import STAGE_NAMES, parse_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineCandidate:
    pp: int
    """Pipeline stages over ranks (1: no pipeline)."""
    layout: str
    """The ZeRO layout inside each stage (ddp, zero1, zero2, zero3)."""
    total_bytes: int
    """Per-rank memory, headroom included (the worst pp rank)."""
    step_s: float
    """One optimizer step, replayed; under a pipeline its bubble included."""
    bubble: float
    fits: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineRecommendation:
    pp: int | None
    """The chosen pp (1: no pipeline), or None when nothing fits."""
    layout: str | None
    fits: bool
    reason: str
    device_mem: int
    candidates: tuple[PipelineCandidate, ...]
    zero3_rows: tuple[PipelineCandidate, ...]
    """ZeRO-3 at every pp weighed (pp 1: ZeRO-3 across every rank, nodes included)."""

    def to_dict(self) -> dict[str, Any]:
        return {"pp": self.pp, "layout": self.layout, "fits": self.fits, "reason": self.reason,
                "device_mem_bytes": self.device_mem,
                "candidates": [dataclasses.asdict(c) for c in self.candidates],
                "zero3_rows": [dataclasses.asdict(c) for c in self.zero3_rows]}


def label(c: PipelineCandidate) -> str:
    from zeroshard.tools.planner.recommend import pretty

    return pretty(c.layout) + (f" in pp {c.pp}" if c.pp > 1 else " without pp")


def pp_options(n_layer: int, world: int, max_pp: int, stages_per_rank: int) -> tuple[int, ...]:
    """Every pp up to ``max_pp`` whose stages divide the blocks and that divides the world."""
    return tuple(p for p in range(2, max_pp + 1)
                 if world % p == 0 and n_layer % (p * stages_per_rank) == 0)


def _verdict(cands: list[PipelineCandidate], mem: int, world: int, hw: Any) -> PipelineRecommendation:
    """The fastest candidate that fits in ``mem``, or the one-line reason nothing does, with ZeRO-3's row
    at each pp to weigh them by."""
    ranked = search.ranked(cands, lambda c: c.step_s, lambda c: c.pp, lambda c: c.layout)
    zero3 = tuple(c for c in cands if c.layout == "zero3")
    rows = "; ZeRO-3 against pp: " + ", ".join(
        f"{label(c)} {gb(c.total_bytes)}, {c.step_s * 1e3:,.1f} ms a step"
        + (f" ({c.bubble:.0%} bubble)" if c.pp > 1 else "") for c in zero3)
    nodes = world // hw.gpus_per_node if world > hw.gpus_per_node else 1
    where = f" ({world} ranks on {nodes} nodes of {hw.gpus_per_node})" if nodes > 1 else ""
    best = search.first_fit(ranked, lambda c: c.fits)
    if best is None:
        small = min(cands, key=lambda c: c.total_bytes)
        reason = (f"nothing fits in {gb(mem)} on the device{where}: the smallest, {label(small)}, needs "
                  f"{gb(small.total_bytes)}; add ranks, raise --pp, or lower the batch" + rows)
        return PipelineRecommendation(pp=None, layout=None, fits=False, reason=reason, device_mem=mem,
                                      candidates=tuple(ranked), zero3_rows=zero3)
    reason = (f"{label(best)} is the fastest that fits{where}: {best.step_s * 1e3:,.1f} ms a step, "
              f"{gb(mem - best.total_bytes)} headroom" + rows)
    return PipelineRecommendation(pp=best.pp, layout=best.layout, fits=True, reason=reason, device_mem=mem,
                                  candidates=tuple(ranked), zero3_rows=zero3)


def recommend_pipeline(cfg: Any, *, device_mem: int | str, world: int, max_pp: int, hw: Any,
                       pp_schedule: str = "1f1b", microbatches: int = 0, pp_stages_per_rank: int = 0,
                       batch: int | None = None, seq: int | None = None, mp: Any = None,
                       optimizer: Any = "adamw", headroom: float = 0.10, device: str = "cuda",
                       accounting: str | None = None) -> PipelineRecommendation:
    """Weigh no pipeline against every pp up to ``max_pp`` for zeroshard's GPT ``cfg`` (a GPTConfig)
    on ``world`` ranks of ``hw`` (a ``zeroshard.tools.sim`` Hardware: its node size and links). ``batch``
    is the global batch per step (default: ``world`` x the microbatches)."""
    from zeroshard.tools.planner.api import plan
    from zeroshard.tools.planner.pipeline import PipelineShape, plan_pipeline
    from zeroshard.tools.sim.pipeline import simulate_pipeline
    from zeroshard.tools.sim.step import Layout, simulate
    from zeroshard.tools.sim.workload import Workload, gpt_shape

    mem = parse_bytes(device_mem)
    shape = PipelineShape.resolve(pp=max(2, max_pp), pp_schedule=pp_schedule, microbatches=microbatches,
                                  pp_stages_per_rank=pp_stages_per_rank)
    m = shape.microbatches
    seq = seq or cfg.seq_len
    batch = batch or world * m
    if batch % world:
        raise ValueError(f"global batch {batch} does not split over the {world} ranks without a pipeline; "
                         f"use a multiple of {world}")
    compute_bytes = 4 if str(mp) == "fp32" else 2
    param_bytes = 4 if str(mp) == "fp32" else 2
    sim_shape = gpt_shape(cfg)
    common = dict(seq=seq, mp=mp, optimizer=optimizer, headroom=headroom, device=device, accounting=accounting)

    cands: list[PipelineCandidate] = []
    flat = plan(cfg, world=world, batch=batch, gpus_per_node=hw.gpus_per_node, **common)
    w = Workload(shape=sim_shape, micro_batch=batch // world, seq=seq, compute_bytes=compute_bytes)
    for stage, name in STAGE_NAMES.items():
        total = flat[name].device.total
        step = simulate(w, hw, Layout.of(world=world, stage=stage, param_bytes=param_bytes)).step_s
        cands.append(PipelineCandidate(pp=1, layout=name, total_bytes=total, step_s=step, bubble=0.0,
                                       fits=total <= mem))
    skipped = []
    for pp in pp_options(cfg.n_layer, world, max_pp, shape.stages_per_rank):
        dp = world // pp
        try:
            pplan = plan_pipeline(cfg, world=world, pp=pp, pp_schedule=shape.schedule, microbatches=m,
                                  pp_stages_per_rank=shape.stages_per_rank, batch=batch, **common)
        except ValueError as e:  # this pp's microbatches do not fit the batch or the schedule
            skipped.append(f"pp {pp}: {e}")
            continue
        w = Workload(shape=sim_shape, micro_batch=batch // (dp * m), seq=seq, compute_bytes=compute_bytes)
        for stage, name in STAGE_NAMES.items():
            total = max(r.plan[name].device.total for r in pplan.ranks)
            timed = simulate_pipeline(w, hw, Layout.of(world=dp, stage=stage, param_bytes=param_bytes), pp=pp,
                                      schedule=shape.schedule, microbatches=m,
                                      stages_per_rank=shape.stages_per_rank, world=world)
            cands.append(PipelineCandidate(pp=pp, layout=name, total_bytes=total, step_s=timed.step_s,
                                           bubble=timed.bubble, fits=total <= mem))
    return _verdict(cands, mem, world, hw)
