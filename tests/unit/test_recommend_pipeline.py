"""The recommender weighing pipeline parallelism against ZeRO across nodes: every candidate is
priced by the planner and the simulator the `plan --pp` and `plan --time --pp` tables use, and the
pick is the fastest that fits."""

from __future__ import annotations

import dataclasses
import json

from zeroshard.cli.main import main
from zeroshard.models import GPTConfig
from zeroshard.tools.planner.pipeline import plan_pipeline
from zeroshard.tools.planner.recommend_pipeline import recommend_pipeline
from zeroshard.tools.sim.hardware import load_hardware
from zeroshard.tools.sim.pipeline import simulate_pipeline
from zeroshard.tools.sim.step import Layout
from zeroshard.tools.sim.workload import Workload, gpt_shape

CFG = GPTConfig.named("small")
HW = dataclasses.replace(load_hardware("h100"), gpus_per_node=4)


def _rec(mem: str):
    return recommend_pipeline(CFG, device_mem=mem, world=8, max_pp=4, hw=HW, seq=256, microbatches=4)


def test_candidates_are_the_pipeline_planner_and_replay_and_the_pick_is_the_fastest_that_fits():
    rec = _rec("80GB")
    assert {c.pp for c in rec.candidates} == {1, 2, 4}
    assert {(c.pp, c.layout) for c in rec.zero3_rows} == {(1, "zero3"), (2, "zero3"), (4, "zero3")}
    pp2 = next(c for c in rec.candidates if (c.pp, c.layout) == (2, "zero3"))
    planned = plan_pipeline(CFG, world=8, pp=2, microbatches=4, batch=32, seq=256)
    assert pp2.total_bytes == max(r.plan["zero3"].device.total for r in planned.ranks)
    w = Workload(shape=gpt_shape(CFG), micro_batch=32 // (4 * 4), seq=256)
    replay = simulate_pipeline(w, HW, Layout.of(world=4, stage=3), pp=2, microbatches=4, world=8)
    assert pp2.step_s == replay.step_s and pp2.bubble == replay.bubble > 0
    fits = [c for c in rec.candidates if c.fits]
    assert rec.fits and (rec.pp, rec.layout) == (fits[0].pp, fits[0].layout)
    assert min(c.step_s for c in fits) >= fits[0].step_s / 1.01
    assert "ZeRO-3 against pp" in rec.reason and "2 nodes of 4" in rec.reason


def test_a_device_only_a_pipeline_fits_picks_the_pipeline():
    whole = _rec("80GB")
    flat = min(c.total_bytes for c in whole.candidates if c.pp == 1)
    staged = min(c.total_bytes for c in whole.candidates if c.pp > 1)
    assert staged < flat
    rec = _rec(str((flat + staged) // 2))
    assert rec.fits and rec.pp > 1
    assert not any(c.fits for c in rec.candidates if c.pp == 1)
    assert not _rec(str(staged - 1)).fits


def test_plan_pp_device_mem_from_the_command_line(capsys):
    args = ["plan", "--model", "small", "--world", "8", "--pp", "4", "--microbatches", "4", "--seq", "256",
            "--gpus-per-node", "4"]
    assert main([*args, "--device-mem", "80GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["recommendation"]
    assert out["fits"] and {c["pp"] for c in out["candidates"]} == {1, 2, 4}
    for extra, flag in ((["--inter-gbps", "100"], "--inter-gbps"), (["--checkpointing", "sqrt"], "--checkpointing"),
                        (["--stage", "3"], "--stage")):
        assert main([*args, "--device-mem", "80GB", *extra]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"drop {flag}" in err[0], err
