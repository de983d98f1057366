"""The pipeline replay of `plan time --pp`: torch's schedule walked microbatch by microbatch.

Each pp rank runs its actions in torch's own order (zeroshard/parallel/pipeline/order.py, the class the
runtime runs): a forward of microbatch j on stage s starts once the rank is free and stage s − 1's
forward of j has arrived over the pp link; a backward once stage s + 1's backward of j has sent
its grad back (the last stage: once its own forward is done). A stage's forward and backward take
its blocks' times (the unit times of zeroshard/tools/sim/step.py, per microbatch); a zero-bubble
schedule's input half waits like a backward, its weight half for its own input half, each taking
half the backward (the first stage: none, and all of it); the last stage also
runs the head and the loss (the root; the embedding lookup of the first stage is left out). At
ZeRO-3 the blocks an action gathers are the ones the stage engine's step schedule gathers in it,
walked in torch's order (``step_schedule``'s ``pipeline_order``: a forward that comes before the
previous microbatch's backward finds the block forward kept still gathered): the first of them
is waited for, the others hidden behind the block before them when shorter. A zero-bubble
schedule's halves gather the stage's blocks at once before they compute
(``Engine.gather_for_split_backward``): nothing hides those.

After its last action a rank does what ``Pipeline.reduce`` and the step do: the tied embedding's
grad all-reduced over the first and last stage, one reduction of its stages' grads over the
stage's data-parallel ranks (``Engine.reduce_accumulated``: all-reduce at stage 0, reduce-scatter
from stage 1), the optimizer's update of its shard and, at stages 1-2, the all-gather of the
updated params; on shared cores (``cores``) that tail shares them with the ranks still computing
or in their own tails, as an action does. The step lasts as long as its slowest rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroshard.parallel.pipeline.order import schedule_order
from zeroshard.parallel.pipeline.replay import StageTimes, equal_time_bubble, replay_order  # noqa: F401  (equal_time_bubble: the sim's public figure)
from zeroshard.tools.sim.hardware import Hardware
from zeroshard.tools.sim.network import collective_seconds, link
from zeroshard.tools.sim.step import Layout, _durations, _optimizer_seconds
from zeroshard.tools.sim.workload import Workload


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankTime:
    pp_rank: int
    schedule_s: float
    """From the step's start to the rank's last backward."""
    busy_s: float
    """Its forwards and backwards (and ZeRO-3's exposed gathers)."""
    tail_s: float
    """After the schedule: tied-grad sum, reduction, optimizer step, stage 1-2 all-gather."""
    span_s: float
    """The whole pipeline's schedule: until the last rank's last backward."""

    @property
    def bubble(self) -> float:
        """Its idle share of the pipeline's schedule (waiting for inputs, or for the others to finish)."""
        return 1.0 - self.busy_s / self.span_s if self.span_s else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineTime:
    step_s: float
    ranks: tuple[RankTime, ...]
    p2p_s: float
    """One activation's (or its grad's) trip between two stages."""
    stage_forward_s: tuple[float, ...]
    stage_backward_s: tuple[float, ...]
    tokens_per_s_per_gpu: float

    @property
    def bubble(self) -> float:
        """The mean over pp ranks of each rank's idle share of the pipeline's schedule."""
        return sum(r.bubble for r in self.ranks) / len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "bubble": self.bubble, "p2p_s": self.p2p_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "stage_forward_s": list(self.stage_forward_s), "stage_backward_s": list(self.stage_backward_s),
                "ranks": [dataclasses.asdict(r) | {"bubble": r.bubble} for r in self.ranks]}


def simulate_pipeline(w: Workload, hw: Hardware, layout: Layout, *, pp: int, schedule: str = "1f1b",
                      microbatches: int = 0, stages_per_rank: int = 1, world: int | None = None,
                      cores: float | None = None) -> PipelineTime:
    """One optimizer step of ``w`` (its ``micro_batch``: one microbatch's sequences on a rank) cut
    into ``pp × stages_per_rank`` stages. ``layout`` is one stage's ZeRO layout (its world: the
    stage's ranks, world / pp); ``world`` every rank of the run (default ``layout.world × pp``),
    which picks the unit times measured under that load. ``cores``: processors the ranks share
    (a CPU host); None gives every rank its own device."""
    from zeroshard.parallel.pipeline.schedules import check_microbatches, schedule_spec

    world = world or layout.world * pp
    spec = schedule_spec(schedule)
    m = microbatches or pp * stages_per_rank
    check_microbatches(spec, microbatches=m, pp=pp, local_batch=m)
    s = w.shape
    n_stages = pp * stages_per_rank
    if s.n_layer % n_stages:
        raise ValueError(f"{n_stages} pipeline stages do not divide the model's {s.n_layer} blocks; pick pp x stages "
                         f"per rank dividing {s.n_layer}")
    blocks = s.n_layer // n_stages
    d = _durations(w, hw, layout.tp, world, synced_per_unit=layout.policy.shard_params, ep=layout.ep)
    gather = 0.0
    if layout.policy.shard_params:  # each block gathered again per microbatch and pass
        group = layout.shard_group
        full = s.block_params / layout.tp * layout.param_bytes
        gather = collective_seconds("all_gather", full, group, hw, world=world)
    def exposed(n: int, block_s: float) -> float:
        """``n`` block gathers in a row: the first waited for, each later one behind the block before it."""
        return gather + (n - 1) * max(0.0, gather - block_s) if gather and n else 0.0

    order = schedule_order(spec, pp=pp, stages_per_rank=stages_per_rank, microbatches=m)
    gathered = _block_gathers(w, layout, order, blocks, pp) if gather else {}
    fwd = [blocks * d.block_fwd + (d.root_fwd if i == n_stages - 1 else 0.0) for i in range(n_stages)]
    bwd = [blocks * d.block_bwd + (d.root_bwd if i == n_stages - 1 else 0.0) for i in range(n_stages)]
    half = [(blocks * d.block_bwd + (d.root_bwd if i == n_stages - 1 else 0.0)) / 2 for i in range(n_stages)]
    # A split backward's half gathers before it computes: every gather waited for.
    waits = {key: n * gather if key[0] in ("I", "W") else exposed(n, d.block_fwd if key[0] == "F" else d.block_bwd)
             for key, n in gathered.items()}
    # Consecutive stages are world / pp ranks apart: on two nodes once a stage fills a node.
    alpha, bandwidth = link(hw, 2, spans=layout.world >= hw.gpus_per_node)
    p2p = alpha + w.tokens * s.hidden * w.compute_bytes / bandwidth
    # The replay walks one pipeline; the stage's other data-parallel (and tp) ranks run the same
    # actions at the same moments in pipelines of their own, so on shared processors one pipeline
    # has cores / (ranks per stage) of them.
    tails = {r: _tail(w, hw, layout, blocks * stages_per_rank, r, pp, world) for r in order}
    finished: dict[int, float] = {}
    walked = replay_order(order, StageTimes(fwd, bwd, half, waits), p2p, None if cores is None else cores / layout.world,
                     tails=tails, finished=finished)
    span = max(end for end, _ in walked.values())
    ranks = []
    for r, (end, busy) in walked.items():
        # The tail as it ran: on shared cores it is slower where other ranks still compute or run theirs.
        ranks.append(RankTime(pp_rank=r, schedule_s=end, busy_s=busy, span_s=span, tail_s=finished[r] - end))
    step = max(r.schedule_s + r.tail_s for r in ranks)
    tokens = w.tokens * m / layout.tp  # each stage's dp ranks share the global batch; a rank sees its slice
    return PipelineTime(step_s=step, ranks=tuple(ranks), p2p_s=p2p, stage_forward_s=tuple(fwd),
                        stage_backward_s=tuple(bwd), tokens_per_s_per_gpu=tokens / pp / step)


def _block_gathers(w: Workload, layout: Layout, order: dict[int, list], blocks: int,
                   pp: int) -> dict[tuple[str, int, int], int]:
    """(kind, stage, microbatch) -> the blocks that action all-gathers (kind F, B, or a split
    backward's I or W; the first stage's W, one whole backward, as B): each stage's step schedule
    over its ``blocks`` blocks, walked in its rank's order of torch's schedule."""
    from zeroshard.parallel.pipeline.order import stage_order
    from zeroshard.runtime.schedule import step_schedule
    from zeroshard.runtime.schedule_events import BACKWARD, FORWARD
    from zeroshard.tools.sim.replay import replay_options, schedule_units

    stage_w = dataclasses.replace(w, shape=dataclasses.replace(w.shape, n_layer=blocks))
    units = schedule_units(stage_w, layout).units
    mesh = dataclasses.replace(layout.mesh, pp=pp)  # one stage's dims, pp of them
    out: dict[tuple[str, int, int], int] = {}
    for actions in order.values():
        for stage in sorted({a.stage for a in actions}):
            schedule = step_schedule(units, policy=layout.policy, mesh=mesh, options=replay_options(stage_w, layout),
                                     pipeline_order=stage_order(actions, stage))
            for e in schedule.collectives:
                if e.op == "all_gather" and e.phase in (FORWARD, BACKWARD) and e.unit.startswith("blocks.") \
                        and not e.mesh:  # the dense part of a block; its experts are their own group
                    key = (e.action, stage, e.micro)
                    out[key] = out.get(key, 0) + 1
    return out


def _tail(w: Workload, hw: Hardware, layout: Layout, blocks: int, pp_rank: int, pp: int, world: int) -> float:
    """A rank's work after its schedule: the tied grad's sum over pp_ends (first and last rank),
    one reduction of its stages' grads, the update, and stages 1-2's all-gather of the update."""
    s = w.shape
    pol = layout.policy
    params = blocks * s.block_params / layout.tp
    if pp_rank in (0, pp - 1):
        params += s.root_params  # the first stage's embeddings, the last stage's head (tied: a copy)
    t = 0.0
    if s.tied and pp_rank in (0, pp - 1):
        t += collective_seconds("all_reduce", s.embedding_params * layout.reduce_bytes, 2, hw,
                                spans=layout.world * (pp - 1) >= hw.gpus_per_node, world=world)
    group = layout.shard_group
    op = "reduce_scatter" if pol.shard_optimizer else "all_reduce"
    p = group if pol.shard_optimizer else layout.dp
    t += collective_seconds(op, params * layout.reduce_bytes, p, hw, world=world)
    t += _optimizer_seconds(w, hw, layout, params / group)
    if pol.shard_optimizer and not pol.shard_params:
        t += collective_seconds("all_gather", params * layout.param_bytes, group, hw, world=world)
    return t
