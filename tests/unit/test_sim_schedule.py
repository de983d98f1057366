"""The step-time simulator launches exactly the collectives the runtime's step schedule issues.

The simulator walks the schedule (zeroshard/tools/sim/replay.py) over the units the engine builds for
uniform blocks; the schedule (zeroshard/runtime/schedule.py) is what the engine issues, checked
against the ledger op by op in tests/distributed/test_schedule.py. Here the replay's launches, in
order, group and size, are held to the schedule's collectives per stage, hybrid layout, prefetch,
resharding, accumulation, bucket size and tp degree; and the units it builds to the engine's
bucketing rule.
"""

from __future__ import annotations

import itertools

import pytest

from zeroshard.models import GPTConfig
from zeroshard.runtime.engine import merge_in_order
from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.options import EngineOptions
from zeroshard.runtime.schedule import step_schedule
from zeroshard.tools.sim.hardware import load_hardware
from zeroshard.tools.sim.replay import schedule_units
from zeroshard.tools.sim.step import Layout, replayed_collectives
from zeroshard.tools.sim.workload import Workload, gpt_shape

SHAPE = gpt_shape(GPTConfig.named("tiny"), "tiny")


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
        layout = Layout.of(**kw)
        sim = replayed_collectives(Workload(shape=SHAPE, micro_batch=1, seq=64, accum=accum), hw, layout)
        units = schedule_units(Workload(shape=SHAPE, micro_batch=1, seq=64), layout).units
        schedule = step_schedule(units, policy=StagePolicy(layout.stage), accum=accum,
                                 mesh=layout.mesh,
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


@pytest.mark.parametrize("bucket_mb", (0.05, 25.0))
def test_the_replays_buckets_are_the_engines(bucket_mb):
    """Stages 0-2: the units the replay builds are the engine's buckets of its blocks and root
    (``reduction_buckets``' rule over fp32 param bytes), each knowing how many blocks it holds."""
    layout = Layout.of(world=2, stage=1, bucket_mb=bucket_mb)
    built = schedule_units(Workload(shape=SHAPE, micro_batch=1, seq=64), layout).units
    sizes = [4 * SHAPE.block_params] * SHAPE.n_layer + [4 * SHAPE.root_params]
    engine = merge_in_order(list(range(SHAPE.n_layer + 1)), lambda i: sizes[i],
                            EngineOptions(bucket_mb=bucket_mb).bucket_bytes)
    assert [u.blocks for u in built] == [sum(i < SHAPE.n_layer for i in b) for b in engine]
    assert [u.is_root for u in built] == [SHAPE.n_layer in b for b in engine]
    assert sum(u.full_numel for u in built) >= SHAPE.root_params + SHAPE.n_layer * SHAPE.block_params
