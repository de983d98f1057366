"""`zeroshard tune` as a user runs it: real spawned gloo ranks, a tiny grid, a TOML that train reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import run_cli
from zeroshard.trainer.config import load_toml, merge_config
from zeroshard.tools.tune.measure import FAULT_ENV

# 2 gloo ranks on the tiny GPT; every timed step is real, so keep them few.
QUICK = ["tune", "--model", "tiny", "--nproc", "2", "--batch", "8", "--seq-len", "32", "--steps", "2",
         "--rounds", "2", "--warmup", "1", "--checkpointing", "none", "--bucket-mb", "25", "--prefetch", "1", "--json"]


def rows_of(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_tune_ranks_measured_candidates_and_writes_a_train_config(tmp_path: Path) -> None:
    proc = run_cli([*QUICK, "--stages", "0,3", "--reshard", "true,false", "--device-mem", "1GB"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = rows_of(proc.stdout)
    assert len(rows) == 3 and all(r["status"] == "ok" for r in rows)
    assert [r["rank"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["timed_steps"] == 4
        assert r["tokens_per_s"] * r["median_step_s"] == pytest.approx(8 * 32)  # useful tokens: the global batch
        assert 0 < r["measured_peak_bytes"] and 0 < r["predicted_allocated_bytes"] < r["predicted_total_bytes"] < 1e9
    assert rows[0]["tokens_per_s"] >= rows[-1]["tokens_per_s"] and rows[0]["winner"] is True
    assert "all built at once" in proc.stderr

    toml = tmp_path / "tuned.toml"  # the default --out, relative to where tune ran
    cfg = merge_config(load_toml(toml))  # what `zeroshard train --config tuned.toml` does
    winner = rows[0]
    assert (cfg.model, cfg.nproc, cfg.batch, cfg.seq_len) == ("tiny", 2, 8, 32)
    assert (cfg.stage, cfg.engine.checkpointing) == (winner["stage"], winner["checkpointing"])
    if winner["stage"] == 3:
        assert (cfg.engine.prefetch, cfg.engine.reshard_after_forward) == (1, winner["reshard_after_forward"])
    assert winner["candidate"] in toml.read_text()


def test_a_failing_candidate_is_reported_and_the_rest_still_measured(tmp_path: Path) -> None:
    out = tmp_path / "conf" / "best.toml"
    broken = "stage 0, bucket 25 MB, ckpt none"
    proc = run_cli([*QUICK, "--stages", "0,3", "--reshard", "true", "--no-resident", "--out", str(out)],
                   env={FAULT_ENV: broken}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = rows_of(proc.stdout)
    assert [(r["candidate"], r["status"]) for r in rows] == [("stage 3, prefetch 1, reshard, ckpt none", "ok"),
                                                            (broken, "failed")]
    assert "every rank: RuntimeError: injected fault" in rows[1]["error"]
    assert rows[0]["tokens_per_s"] > 0
    assert "each rebuilt in its turn" in proc.stderr and f"failed {broken}" in proc.stderr
    assert merge_config(load_toml(out)).stage == 3


def test_tune_under_a_pipeline_measures_its_schedules_and_writes_a_pp_config(tmp_path: Path) -> None:
    # One spawn of 2 gloo ranks as pp 2: stages 0 and 3 inside each stage x two microbatch counts.
    proc = run_cli(["tune", "--model", "tiny", "--nproc", "2", "--pp", "2", "--pp-schedule", "gpipe", "--batch", "8",
                    "--seq-len", "32", "--steps", "2", "--rounds", "2", "--warmup", "1", "--bucket-mb", "25",
                    "--prefetch", "1", "--reshard", "true", "--stages", "0,3", "--microbatch-counts", "2,4",
                    "--checkpointing", "none", "--device-mem", "1GB", "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = rows_of(proc.stdout)
    assert sorted((r["stage"], r["microbatches"]) for r in rows) == [(0, 2), (0, 4), (3, 2), (3, 4)]
    for r in rows:
        assert r["status"] == "ok" and r["timed_steps"] == 4 and r["tokens_per_s"] > 0
        assert r["tokens_per_s"] * r["median_step_s"] == pytest.approx(8 * 32)
        assert r["checkpointing"] == "none" and r["measured_peak_bytes"] is None
    cfg = merge_config(load_toml(tmp_path / "tuned.toml"))
    assert (cfg.pp, cfg.pp_schedule, cfg.nproc) == (2, "gpipe", 2)
    assert (cfg.stage, cfg.microbatches) == (rows[0]["stage"], rows[0]["microbatches"])


def test_tune_searches_expert_parallel_degrees_and_writes_the_winners_ep(tmp_path: Path) -> None:
    # One spawn of 2 gloo ranks on tiny-moe: ZeRO-3 at ep 1 and ep 2 (each on its own mesh in the spawn).
    proc = run_cli(["tune", "--model", "tiny-moe", "--nproc", "2", "--batch", "4", "--seq-len", "16", "--steps", "1",
                    "--rounds", "2", "--warmup", "0", "--stages", "3", "--prefetch", "1", "--reshard", "true",
                    "--checkpointing", "none", "--ep-degrees", "1,2", "--device-mem", "1GB", "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = rows_of(proc.stdout)
    assert sorted(r["ep"] for r in rows) == [1, 2]
    for r in rows:
        assert r["status"] == "ok" and r["timed_steps"] == 2 and r["candidate"].endswith(f", ep {r['ep']}")
        assert r["tokens_per_s"] * r["median_step_s"] == pytest.approx(4 * 16)
    peak = {r["ep"]: r["measured_peak_bytes"] for r in rows}
    predicted = {r["ep"]: r["predicted_allocated_bytes"] for r in rows}
    # ep 2 really ran split: a rank holds (and gathers) only its two experts, measured and as the planner says.
    assert 0 < peak[2] < peak[1] and predicted[2] < predicted[1]
    cfg = merge_config(load_toml(tmp_path / "tuned.toml"))
    assert (cfg.model, cfg.nproc, cfg.stage, cfg.ep) == ("tiny-moe", 2, 3, rows[0]["ep"])
