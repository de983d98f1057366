"""The step schedule against the ledger, op by op, and the planner against the ledger's bytes.

Over a matrix of configs (stage 0-3 × reshard_after_forward × prefetch 0-2 × accumulation {1,
2 sharded, 2 unsharded} × checkpointing {none, all} × offload {none, cpu} × comm quant {none,
weights, grads} × bucket size × clipping, where valid for the stage) on world 2, world 4, a
hybrid mesh of 2 replicas × 2 shards and tp 2 × 2 data-parallel ranks, each config trains tiny for
two steps in one spawned world per size. Every collective of each step (less the step's token-count all-reduce) must be the
schedule's next event: same op, group, unit, phase, numel, dtype and bytes, in order (step 1
against ``first_step=True``, step 2 against the steady state); every free must be the engine's
next FREE event; and the planner's collectives for the same config must move step 2's bytes per
(op, group). With tp, DTensor's per-block all-reduces are the schedule's too: at stage 3 in place,
at stages 0-2 as the tp group's own sequence. By default world 2 runs a pairwise cover of the dims
plus a few extras (bf16, longer checkpoint segments), the hybrid mesh a pairwise cover and world 4
and the tp mesh every value once;
ZEROSHARD_SCHEDULE_MATRIX=full (or pairwise, each) runs that matrix on every world instead.
"""

from __future__ import annotations

import os

import pytest

import schedule_workloads as sw
from zeroshard.trainer.launch import spawn
from zeroshard.models import GPTConfig
from zeroshard.tools.planner import plan
from zeroshard.tools.planner.spec import STAGE_NAMES

# One spawn per world runs every config; on a loaded two-core machine it can outlast the default
# per-test timeout, which the first test of each world pays for.
pytestmark = pytest.mark.timeout(1800)

_MODE = os.environ.get("ZEROSHARD_SCHEDULE_MATRIX")
WORLDS = {  # name: (world, shard_size, tp, matrix mode, extras)
    "world2": (2, None, 1, _MODE or "pairwise", True),
    "world4": (4, None, 1, _MODE or "each", False),
    "hybrid2x2": (4, 2, 1, _MODE or "pairwise", False),
    "tp2xdp2": (4, None, 2, _MODE or "each", False),
}


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request):
    size, shard, tp, mode, extras = WORLDS[request.param]
    ranks = spawn(sw.schedule_suite, size, args=(mode, extras, shard, tp), timeout_s=1700)
    return request.param, size, shard, tp, ranks


def test_schedule_matches_the_ledger_op_by_op(world):
    name, size, shard, tp, ranks = world
    assert ranks[0]["mesh"]["shard_size"] == (shard or size // tp)
    mismatches, collectives, frees = [], 0, 0
    for rank, result in enumerate(ranks):
        for case in result["results"]:
            for index, stepped in enumerate(case["steps"], start=1):
                collectives += stepped["collectives"]
                frees += stepped["frees"]
                if stepped["diff"] or stepped["free_diff"]:
                    mismatches.append((rank, index, case["name"], stepped["diff"], stepped["free_diff"]))
    configs = len(ranks[0]["results"])
    print(f"{name}: {configs} configs x 2 steps x {size} ranks, {collectives} collectives and {frees} frees "
          f"compared with the schedule in {ranks[0]['seconds']:.0f} s; {len(mismatches)} steps differ")
    assert not mismatches, mismatches[:3]


def _layout_name(cfg: dict, shard: int | None) -> str:
    """The plan's layout for a config: hybrid on the 2 x 2 mesh (offload does not change what is sent,
    and the plan offloads only over the whole world), offload when asked, else the stage's own."""
    name = STAGE_NAMES[cfg["stage"]]
    if shard is not None and cfg["stage"] > 0:
        return f"{name}_hybrid"
    return f"{name}_offload" if cfg["offload"] != "none" else name


def test_planner_collectives_equal_the_ledger(world):
    name, size, shard, tp, ranks = world
    model = GPTConfig.named("tiny", seq_len=sw.SEQ)
    wrong = []
    for case in ranks[0]["results"]:
        cfg = case["config"]
        p = plan(model, world=size, stage=cfg["stage"], batch=sw.BATCH, seq=sw.SEQ, accum=cfg["accum"],
                 accumulation=cfg["accumulation"], checkpointing=cfg["checkpointing"], offload=cfg["offload"],
                 shard_size=shard, prefetch=cfg["prefetch"], reshard_after_forward=cfg["reshard_after_forward"],
                 bucket_mb=cfg["bucket_mb"], comm_quant=cfg["comm_quant"], mp=cfg["mp"], device="cpu", tp=tp)
        planned: dict[str, int] = {}
        for c in p[_layout_name(cfg, shard)].collectives:
            planned[f"{c.op}:{c.group}"] = planned.get(f"{c.op}:{c.group}", 0) + c.buffer_bytes * c.count
        measured = case["steps"][1]["bytes_by"]  # step 2: the steady state the planner plans
        if planned != measured:
            wrong.append((case["name"], planned, measured))
    print(f"{name}: the planner's bytes per (op, group) equal the ledger's for "
          f"{len(ranks[0]['results']) - len(wrong)} of {len(ranks[0]['results'])} configs")
    assert not wrong, wrong[:3]
