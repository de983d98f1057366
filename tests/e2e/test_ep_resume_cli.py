"""`zeroshard train --ep 2 --save-every`, then `--resume auto` at `--ep 4`: the resumed run
continues the uninterrupted one (tiny-moe with its load-balancing loss, stage 3, 4 ranks), and
the offline tools take the ep checkpoint as any other.

Two `zeroshard train` runs: the uninterrupted one at ep 2 saving every step (asynchronously), and
its step-2 checkpoint resumed at ep 4 for the last step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_cli import read_metrics, run_cli
from test_resize_cli import max_diff, params

TOL = 1e-5  # the stage-0 tolerance of the parity tests
MOE = ["--model", "tiny-moe", "--batch", "8", "--seq-len", "32", "--num-samples", "256", "--nproc", "4",
       "--stage", "3", "--steps", "3", "--warmup", "1", "--save-every", "1", "--keep-last", "0"]


def train(tmp: Path, name: str, *extra: str) -> tuple[Path, Path, str]:
    ckpt, run_dir = tmp / f"{name}-ck", tmp / f"{name}-run"
    done = run_cli(["train", *MOE, "--ckpt-dir", str(ckpt), "--run-dir", str(run_dir), *extra])
    assert done.returncode == 0, done.stdout + done.stderr
    return ckpt, run_dir, done.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, Path]:
    # Saved in the background: the asynchronous save's snapshot takes each rank's block of experts too.
    return train(tmp_path_factory.mktemp("ep_resume"), "ep2", "--ep", "2", "--save-async")[:2]


def test_resume_at_another_ep_continues_the_run(tmp_path, uninterrupted):
    ckpt2, run2 = uninterrupted
    shutil.copytree(ckpt2 / "step-00000002", tmp_path / "ep4-ck" / "step-00000002")
    shutil.copytree(run2, tmp_path / "ep4-run")  # a relaunch keeps its run dir
    ckpt4, run4, out = train(tmp_path, "ep4", "--ep", "4", "--resume", "auto")
    assert "saved on 4 ranks at stage 3, experts split over ep 2; now 4 ranks at stage 3, experts split over " \
           "ep 4" in out, out
    update = max_diff(params(ckpt2 / "step-00000003", tmp_path), params(ckpt4 / "step-00000003", tmp_path))
    ours, theirs = read_metrics(run4), read_metrics(run2)
    losses = max(abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs, strict=True))
    print(f"ep 2 -> ep 4 at step 2: next update max|param diff| {update:.1e} against the uninterrupted ep-2 run; "
          f"loss max|diff| {losses:.1e}")
    assert update <= TOL and losses <= TOL
    assert [m["step"] for m in ours] == [1, 2, 3]
    manifest = json.loads((ckpt4 / "step-00000003" / "manifest.json").read_text())
    assert manifest["mesh"]["ep_size"] == 4
    assert {p["ep"]["ep"] for p in manifest["params"] if "ep" in p} == {4}


def test_offline_tools_take_an_ep_checkpoint(tmp_path, uninterrupted):
    source = uninterrupted[0] / "step-00000003"
    shown = run_cli(["ckpt", "inspect", str(source)])
    assert shown.returncode == 0 and "saved on 4 ranks at stage 3, experts split over ep 2" in shown.stdout
    done = run_cli(["ckpt", "reshard", str(source), str(tmp_path / "ep1"), "-w", "2", "--ep", "1"])
    assert done.returncode == 0, done.stderr
    checked = run_cli(["ckpt", "verify", str(source), str(tmp_path / "ep1")])
    assert checked.returncode == 0 and checked.stdout.count("OK") == 2, checked.stdout + checked.stderr
    assert max_diff(params(source, tmp_path), params(tmp_path / "ep1", tmp_path)) == 0
    refused = run_cli(["ckpt", "reshard", str(source), str(tmp_path / "ep3"), "-w", "4", "--ep", "3"])
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip() == "zeroshard ckpt: error: ep 3 does not divide world 4; pick an ep that divides " \
                                     "it (world = ep x the ranks that shard each block of experts)"
