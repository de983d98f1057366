"""The step-time simulator replays the collectives the runtime's step schedule says a step issues.

The simulator times a step of uniform blocks (zeroshard/sim/step.py); the schedule
(zeroshard/sharding/schedule.py) is what the engine issues, checked against the ledger op by op in
tests/distributed/test_schedule.py. Both are given the same unit sizes here, so what is compared
is the schedule itself: which collectives the replay launches, in which order and group and how
large, per stage, hybrid layout, prefetch, resharding, accumulation, bucket size and tp degree.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from zeroshard.models import GPTConfig
from zeroshard.sharding.engine import merge_in_order
from zeroshard.sharding.flat import StagePolicy
from zeroshard.sharding.options import EngineOptions
from zeroshard.sharding.schedule import GroupSizes, MeshSizes, UnitSizes, step_schedule
from zeroshard.sim.hardware import load_hardware
from zeroshard.sim.step import Layout, replayed_collectives
from zeroshard.sim.workload import Workload, gpt_shape

DTYPES = {2: torch.bfloat16, 4: torch.float32}
SHAPE = gpt_shape(GPTConfig.named("tiny"), "tiny")


def schedule_units(layout: Layout) -> list[UnitSizes]:
    """The engine's units for the simulated shape: each block's tp-local params and the root, in
    reduction order; at stages 0-2 merged into the engine's buckets (by fp32 bytes, as it fills them)."""
    shards = layout.shard_group

    def unit(name: str, numel: int, root: bool = False) -> UnitSizes:
        assert numel % shards == 0  # the shape needs no padding, so both sides count the same elements
        return UnitSizes(name=name, is_root=root, groups=(GroupSizes(
            numel=numel, shard_numel=numel // shards, compute_dtype=DTYPES[layout.param_bytes],
            reduce_dtype=DTYPES[layout.reduce_bytes]),))

    units = [unit(f"blocks.{i}", SHAPE.block_params // layout.tp) for i in reversed(range(SHAPE.n_layer))]
    units.append(unit("<root>", SHAPE.root_params, root=True))
    if layout.policy.shard_params:
        return units
    buckets = merge_in_order(units, lambda u: 4 * u.full_numel, EngineOptions(bucket_mb=layout.bucket_mb).bucket_bytes)
    return [unit(f"bucket.{i}", sum(u.full_numel for u in b), root=any(u.is_root for u in b))
            for i, b in enumerate(buckets)]


LAYOUTS = [dict(world=w, stage=s, shards=sh, tp=tp, prefetch=p, reshard_after_forward=r, bucket_mb=b, offload=o)
           for w, s, sh, tp, p, r, b, o in itertools.product(
               (2, 4), (0, 1, 2, 3), (None, 2), (1, 2), (1, 2), (True, False), (0.05, 25.0), ("none", "cpu"))
           if not (sh is not None and (sh >= w // tp or s == 0 or o != "none")) and not (w == 2 and tp == 2)
           and (s == 3 or (p == 1 and r)) and (s != 3 or b == 25.0)]
"""Every knob only where the runtime reads it: prefetch and resharding at stage 3, buckets below it;
hybrid layouts without offload (which the simulator, like the planner, prices over the whole world)."""


@pytest.mark.parametrize("accum", (1, 2))
def test_the_replay_launches_what_the_step_schedule_issues(accum):
    hw = load_hardware("h100")
    checked = 0
    for kw in LAYOUTS:
        layout = Layout(**kw)
        sim = replayed_collectives(Workload(shape=SHAPE, micro_batch=1, seq=64, accum=accum), hw, layout)
        units = schedule_units(layout)
        schedule = step_schedule(units, policy=StagePolicy(layout.stage), accum=accum,
                                 mesh=MeshSizes(world=layout.world, shard=layout.shard_group, tp=layout.tp),
                                 options=EngineOptions(prefetch=layout.prefetch, bucket_mb=layout.bucket_mb,
                                                       reshard_after_forward=layout.reshard_after_forward,
                                                       offload=layout.offload))
        runtime = [(e.op, e.group == "replicate", e.bytes) for e in schedule.collectives]
        replay = [(op, stream == "replicate", nbytes) for op, stream, nbytes in sim]
        if layout.policy.gathers_after_step:
            # Stages 1-2 gather the updated params after the step: the replay as one all-gather of
            # every param, the engine per optimizer call. The bytes must agree, not the count.
            after = [e.bytes for e in schedule.collectives if e.phase == "param_sync"]
            runtime = runtime[:len(runtime) - len(after)]
            assert replay.pop() == ("all_gather", False, sum(after)), kw
        assert replay == runtime, f"{kw}: the replay launches\n{replay}\nthe schedule issues\n{runtime}"
        checked += 1
    assert checked == len(LAYOUTS) > 60
