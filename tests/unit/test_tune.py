"""`zeroshard tune` without spawning ranks: the grid, planner pruning, ranking and the TOML it writes."""

from __future__ import annotations

import dataclasses

import math
from pathlib import Path

import pytest

from zeroshard.trainer.config import TrainConfig, load_toml, merge_config, tomllib
from zeroshard.tools.tune import choose, tomlfile
from zeroshard.tools.tune.grid import DEFAULT_AXES, Candidate, candidates, default_candidates, parse_axes
from zeroshard.tools.tune.prune import Prediction, predict, prune

# Model states dominate at this size (tiny batch), so sharding them is what decides the fit.
BASE = TrainConfig(model="tiny", nproc=2, batch=2, seq_len=16)


def axes(**overrides: str):
    return parse_axes(**{**DEFAULT_AXES, **overrides})


def test_default_grid_varies_each_knob_only_where_the_runtime_reads_it() -> None:
    grid = default_candidates()
    # stages 0-2: 2 bucket sizes x 2 policies; stage 3: 2 prefetch x 2 reshard x 2 policies.
    assert len(grid) == 3 * 2 * 2 + 2 * 2 * 2 == len(set(grid))
    for c in grid:
        if c.stage == 3:
            assert c.bucket_mb is None and c.prefetch in (1, 2) and c.reshard_after_forward in (True, False)
            assert set(c.train_keys()) == {"stage", "checkpointing", "prefetch", "reshard_after_forward", "comm_quant"}
        else:
            assert c.prefetch is None and c.reshard_after_forward is None and c.bucket_mb in (5.0, 25.0)
            assert set(c.train_keys()) == {"stage", "checkpointing", "bucket_mb", "comm_quant"}
    assert len({c.name for c in grid}) == len(grid)
    assert {c.comm_quant for c in grid} == {"none"}  # quantized comm is tried only when asked


def test_flags_narrow_the_grid_and_repeats_collapse() -> None:
    grid = candidates(axes(stages="3,3", prefetch="0,2", reshard="false", checkpointing="every:2"))
    assert [(c.prefetch, c.reshard_after_forward, c.checkpointing) for c in grid] == [(0, False, "every:2"),
                                                                                      (2, False, "every:2")]


@pytest.mark.parametrize(("flag", "text", "needle"), [
    ("stages", "0,4", "--stages: '4' is not a stage"),
    ("stages", "", "--stages '': give a comma-separated list"),
    ("prefetch", "1,,2", "--prefetch '1,,2'"),
    ("prefetch", "-1", "--prefetch: '-1' is not a value of prefetch: prefetch=-1 must be >= 0"),
    ("prefetch", "1.5", "--prefetch: '1.5' is not a value of prefetch: it is not an integer"),
    ("bucket_mb", "0", "--bucket-mb: '0' is not a value of bucket_mb: bucket_mb=0.0 must be > 0"),
    ("bucket_mb", "big", "--bucket-mb: 'big' is not a value of bucket_mb: it is not a finite number"),
    ("bucket_mb", "inf", "--bucket-mb: 'inf'"),
    ("checkpointing", "none,every:0", "--checkpointing: 'every:0' is not a value of checkpointing: checkpointing="),
    ("reshard", "maybe", "--reshard: 'maybe' is not a value of reshard_after_forward: it is not true or false"),
])
def test_bad_grid_values_name_the_flag(flag: str, text: str, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        axes(**{flag: text})
    assert needle in str(info.value)


def test_tiny_budget_prunes_stage_0_keeps_stage_3_and_says_why() -> None:
    grid = candidates(axes(stages="0,3", checkpointing="none", bucket_mb="25", prefetch="1", reshard="true"))
    ddp, zero3 = grid
    predicted = predict(grid, BASE)
    assert predicted[zero3].total < predicted[ddp].total
    assert 0 < predicted[zero3].allocated < predicted[zero3].total  # headroom on top of the live peak
    budget = (predicted[zero3].total + predicted[ddp].total) // 2
    kept, pruned = prune(grid, predicted, budget)
    assert kept == [zero3]
    assert [p.candidate for p in pruned] == [ddp]
    reason = pruned[0].reason
    assert f"predicted {predicted[ddp].total / 1e6:.1f} MB per rank" in reason
    assert f"budget {budget / 1e6:.1f} MB" in reason
    assert prune(grid, predicted, None) == (grid, [])


def test_prediction_follows_the_stage_3_knobs() -> None:
    grid = candidates(axes(stages="3", checkpointing="none", prefetch="1,2", reshard="true,false"))
    # At 64 tokens the peak is where the gathered window shows; at 16 it is a grad collection near
    # the end of backward, where every knob holds the same params (measured identical too).
    predicted = predict(grid, dataclasses.replace(BASE, seq_len=64))
    by = {(c.prefetch, c.reshard_after_forward): predicted[c].allocated for c in grid}
    # A deeper prefetch window holds more gathered blocks; no reshard holds every unit's params.
    assert by[(1, True)] < by[(2, True)] <= by[(1, False)] == by[(2, False)]


def _row(c: Candidate, tps: float, status: str = "ok") -> dict:
    row = {"candidate": c.name, **c.train_keys(), "status": status}
    if status == "ok":
        row.update(tokens_per_s=tps, median_step_s=BASE.batch * BASE.seq_len / tps, spread=0.1,
                   measured_peak_bytes=1000)
    else:
        row["error"] = "every rank: RuntimeError: boom"
    return row


def test_rank_orders_by_tokens_per_second_then_failed_then_pruned() -> None:
    a, b, c, d = candidates(axes(stages="0,1,2,3", checkpointing="none", bucket_mb="25", prefetch="1",
                                 reshard="true"))
    predictions = {x: Prediction(total=200, allocated=180) for x in (a, b, c, d)}
    _, pruned = prune([d], {d: Prediction(total=500, allocated=450)}, 300)
    ranked = choose.rank([_row(a, 100.0), _row(b, 300.0), _row(c, 0.0, "failed")], [a, b, c], predictions, pruned)
    assert [r["candidate"] for r in ranked] == [b.name, a.name, c.name, d.name]
    assert [r.get("rank") for r in ranked] == [1, 2, None, None]
    assert ranked[1]["vs_best"] == pytest.approx(1 / 3)
    assert ranked[3]["status"] == "pruned" and "> budget" in ranked[3]["reason"]
    assert all(r["predicted_total_bytes"] for r in ranked)


def test_toml_writer_round_trips_flat_scalars() -> None:
    values = {"a": 1, "b": 2.5, "c": 1e-05, "d": 1e16, "e": True, "f": False, "g": None, "h": math.inf,
              "path": 'C:\\runs\\"x"\n\tend\x01', "dashed-key": "é", "odd key": 3}
    text = tomlfile.dumps(values, header="first line\nsecond")
    assert text.startswith("# first line\n# second\n")
    assert tomllib.loads(text) == {k: v for k, v in values.items() if v is not None}
    assert tomllib.loads(tomlfile.dumps({"x": [1, 2.5]})) == {"x": [1, 2.5]}  # an optimizer's betas
    with pytest.raises(TypeError, match="set"):
        tomlfile.dumps({"x": {1}})


@pytest.mark.parametrize("winner", [
    Candidate(stage=3, checkpointing="sqrt", prefetch=2, reshard_after_forward=False),
    Candidate(stage=1, checkpointing="every:2", bucket_mb=5.0),
])
def test_winning_config_loads_as_train_does(tmp_path: Path, winner: Candidate) -> None:
    base = TrainConfig(model="tiny", nproc=2, batch=8, seq_len=32, lr=3e-3, min_lr=1e-5, run_dir="runs/a b")
    row = _row(winner, 1234.0)
    ranked = [row]
    path = tomlfile.write(tmp_path / "sub" / "tuned.toml", choose.tuned_values(base, row),
                          header=choose.header(row, ranked, base, 2_000_000_000))
    assert "2.00 GB per rank" in path.read_text()
    cfg = merge_config(load_toml(path))  # what `zeroshard train --config` does with the file
    assert (cfg.stage, cfg.engine.checkpointing) == (winner.stage, winner.checkpointing)
    if winner.stage == 3:
        assert (cfg.engine.prefetch, cfg.engine.reshard_after_forward) == (2, False)
    else:
        assert cfg.engine.bucket_mb == 5.0
    # The workload and the base's own settings survive; untouched defaults stay out of the file.
    assert (cfg.model, cfg.nproc, cfg.batch, cfg.seq_len, cfg.lr, cfg.min_lr, cfg.run_dir) == (
        "tiny", 2, 8, 32, 3e-3, 1e-5, "runs/a b")
    assert "steps" not in load_toml(path)


def test_cli_rejects_bad_flags_before_measuring(capsys: pytest.CaptureFixture[str]) -> None:
    from zeroshard.cli.main import main

    assert main(["tune", "--stages", "0,5"]) == 1
    assert "zeroshard tune: error: --stages: '5' is not a stage" in capsys.readouterr().err
    # tune measures real steps, so its model is one `zeroshard train` builds (a module:Class is planned only):
    # one line saying so and naming the plan command that takes it.
    assert main(["tune", "--model", "torch.nn:Linear"]) == 1
    err = capsys.readouterr().err
    assert "as zeroshard train does" in err and "zeroshard plan memory --model torch.nn:Linear" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert main(["tune", "--device-mem", "lots"]) == 1
    assert "cannot read memory size 'lots'" in capsys.readouterr().err
    assert main(["tune", "--rounds", "0"]) == 1
    assert "rounds=0" in capsys.readouterr().err


def test_cli_says_when_nothing_fits(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from zeroshard.cli.main import main

    out = tmp_path / "tuned.toml"
    assert main(["tune", "--model", "tiny", "--batch", "2", "--seq-len", "16", "--stages", "0,3",
                 "--checkpointing", "none", "--bucket-mb", "25", "--prefetch", "1", "--reshard", "true",
                 "--device-mem", "1MB", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "no candidate fits 1.0 MB per rank: the smallest, stage 3" in err
    assert not out.exists()


def test_comm_quant_axis_only_where_the_stage_accepts_it():
    grid = candidates(axes(stages="0,2,3", checkpointing="none", bucket_mb="25", prefetch="1", reshard="true",
                           comm_quant="none,weights/grads+ef,grads"))
    by_stage: dict[int, list[str]] = {}
    for c in grid:
        by_stage.setdefault(c.stage, []).append(c.comm_quant)
        TrainConfig(**c.train_keys())  # every candidate is a config the runtime accepts
    assert by_stage == {0: ["none"], 2: ["none", "grads"], 3: ["none", "weights,grads+ef", "grads"]}
    assert "comm weights,grads+ef" in [c for c in grid if c.comm_quant == "weights,grads+ef"][0].name
    assert axes(comm_quant="none,weights,grads").comm_quant == ("none", "weights", "grads")  # three settings
    with pytest.raises(ValueError, match="--comm-quant"):
        axes(comm_quant="weight")
    with pytest.raises(ValueError, match="--comm-quant"):
        axes(comm_quant="grads/grads+ef")


def test_pipeline_axes_predictions_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    from zeroshard.cli.main import main
    from zeroshard.models import GPTConfig
    from zeroshard.tools.planner.pipeline import plan_pipeline

    grid = candidates(axes(stages="0,3", checkpointing="none", bucket_mb="25", prefetch="1", reshard="true",
                           pp_schedules="1f1b,gpipe", microbatches="2,4"))
    assert sorted({(c.pp_schedule, c.microbatches) for c in grid}) == [
        ("1f1b", 2), ("1f1b", 4), ("gpipe", 2), ("gpipe", 4)]
    assert len(grid) == 8 and "gpipe, 4 microbatches" in grid[-1].name
    base = TrainConfig(model="tiny", nproc=2, batch=8, seq_len=32, pp=2, stage=3)
    predicted = predict(grid, base)
    for c in grid:  # the pipeline planner's worst pp rank, as `plan --pp` plans it
        gpt = GPTConfig.named("tiny", vocab_size=base.vocab_size, seq_len=32)  # the model train builds
        pplan = plan_pipeline(gpt, world=2, pp=2, mp=base.mp, pp_schedule=c.pp_schedule, microbatches=c.microbatches,
                              batch=8, seq=32, device="cpu", prefetch=1, reshard_after_forward=True, bucket_mb=25)
        layout = "ddp" if c.stage == 0 else "zero3"
        assert predicted[c].total == max(r.plan[layout].device.total for r in pplan.ranks)
        TrainConfig(**{**base.to_dict(), **c.train_keys()})  # each is a config train accepts
    zb = candidates(axes(stages="3", checkpointing="none,sqrt", prefetch="1", reshard="true",
                         pp_schedules="1f1b,interleaved-zero-bubble"))
    assert sorted((c.pp_schedule, c.checkpointing) for c in zb) == [
        ("1f1b", "none"), ("1f1b", "sqrt"), ("interleaved-zero-bubble", "none")]  # as the runtime refuses it
    gpipe = {c.microbatches: predicted[c].allocated for c in grid if c.pp_schedule == "gpipe" and c.stage == 0}
    assert gpipe[4] != gpipe[2]
    quick = ["tune", "--model", "tiny", "--nproc", "2", "--batch", "8", "--seq-len", "32"]
    for extra, needle in ((["--microbatch-counts", "2,4"], "add --pp N"),
                          (["--pp", "2", "--pp-schedule", "interleaved-zero-bubble", "--checkpointing", "sqrt"],
                           "zero-bubble"),
                          (["--pp", "2", "--pp-schedules", "1f1b,nope"], "nope")):
        assert main([*quick, *extra]) == 1
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


MOE = TrainConfig(model="tiny-moe", nproc=4, batch=4, seq_len=16)


def test_ep_axis_predictions_come_from_the_planner_at_each_degree(tmp_path: Path) -> None:
    from zeroshard.models import GPTConfig
    from zeroshard.tools.planner.api import plan

    grid = candidates(axes(stages="0,3", checkpointing="none", bucket_mb="25", prefetch="1", reshard="true",
                           ep_degrees="1,2,4"))
    assert sorted((c.stage, c.ep) for c in grid) == [(s, e) for s in (0, 3) for e in (1, 2, 4)]
    assert all(c.name.endswith(f", ep {c.ep}") and c.train_keys()["ep"] == c.ep for c in grid)
    for c in grid:
        TrainConfig(**{**MOE.to_dict(), **c.train_keys()})  # each is a config train accepts
    predicted = predict(grid, MOE)
    gpt = GPTConfig.named("tiny-moe", vocab_size=MOE.vocab_size, seq_len=16)  # the model train builds
    for c in grid:  # the planner's own figure at the candidate's ep, as `plan --ep N` plans it
        p = plan(gpt, world=4, ep=c.ep, batch=4, seq=16, device="cpu", optimizer="adamw", prefetch=1,
                 reshard_after_forward=True, bucket_mb=25, optimizer_kwargs={"weight_decay": MOE.weight_decay,
                                                                              "foreach": True})
        layout = p["ddp" if c.stage == 0 else "zero3"].device
        assert predicted[c] == Prediction(total=layout.total, allocated=layout.allocated)
    zero3 = {c.ep: predicted[c].allocated for c in grid if c.stage == 3}
    assert len(set(zero3.values())) == 3  # the degree changes what a rank holds
    # A fixed --ep (no axis): every candidate at the base's ep, predicted at it.
    fixed = candidates(axes(stages="3", checkpointing="none", prefetch="1", reshard="true"))
    assert predict(fixed, dataclasses.replace(MOE, ep=2))[fixed[0]].allocated == zero3[2]
    # Under a pipeline: the worst pp rank's figure at each degree, each stage's experts split over ep.
    pp_grid = candidates(axes(stages="3", checkpointing="none", prefetch="1", reshard="true", ep_degrees="1,2"))
    piped = predict(pp_grid, dataclasses.replace(MOE, pp=2))
    assert piped[pp_grid[0]].allocated > piped[pp_grid[1]].allocated > 0
    # The winner's ep reaches the file train reads.
    row = _row(next(c for c in grid if c.ep == 2), 100.0)
    path = tomlfile.write(tmp_path / "tuned.toml", choose.tuned_values(MOE, row))
    assert merge_config(load_toml(path)).ep == 2


def test_ep_refusals_are_one_line_before_measuring(capsys: pytest.CaptureFixture[str]) -> None:
    from zeroshard.cli.main import main
    from zeroshard.tools.planner.api import plan

    quick = ["tune", "--model", "tiny-moe", "--nproc", "4", "--batch", "4", "--seq-len", "16"]
    for argv, needle in (
            (["tune", "--model", "tiny", "--nproc", "2", "--ep", "2"], "tiny has no MoE layer"),  # as train says
            (["tune", "--model", "tiny", "--nproc", "2", "--ep-degrees", "1,2"], "tiny has no MoE layer"),
            ([*quick, "--ep-degrees", "1,2,8"], "ep=8 does not divide the 4 data-parallel ranks"),
            ([*quick, "--nproc", "8", "--batch", "8", "--ep-degrees", "8"], "does not divide the 4 experts"),
            ([*quick, "--ep-degrees", "1,x"], "'x' is not an expert-parallel degree"),
            ([*quick, "--ep", "2", "--ep-degrees", "1,2"], "give one of them"),
            ([*quick, "--pp", "2", "--ep", "4"], "ep=4 does not divide")):  # a stage's 2 ranks
        assert main(argv) == 1, argv
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    # ep with tp: tune predicts it when the planner does, and refuses it in the planner's words when not.
    try:
        plan("tiny-moe", world=4, tp=2, ep=2, batch=4, seq=16, device="cpu")
    except ValueError as e:
        assert main([*quick, "--tp", "2", "--ep", "2"]) == 1
        err = capsys.readouterr().err.strip()
        assert str(e) in err and len(err.splitlines()) == 1, err
    else:
        grid = candidates(axes(stages="3", checkpointing="none", prefetch="1", reshard="true"))
        assert predict(grid, dataclasses.replace(MOE, tp=2, ep=2))[grid[0]].total > 0
