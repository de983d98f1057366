"""Shrink and grow: `--resume auto` on another number of ranks keeps the global batch by changing
accumulation, says so, and continues the uninterrupted run at the new world (stage 3, tiny).

Four `zeroshard train` runs: the uninterrupted references at 4 ranks x accum 1 and 2 ranks x accum 2
(the same micro-batch of 2 sequences), then each one's step-2 checkpoint resumed on the other world.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_cli import FAST, read_metrics, run_cli

from zeroshard.checkpoint import export

TOL = 1e-5  # the stage-0 tolerance of the parity tests: the same sums in another order
STEPS = ["--steps", "4", "--warmup", "2", "--stage", "3", "--save-every", "1", "--keep-last", "0"]
WORLDS = {4: ["--nproc", "4", "--accum", "1"], 2: ["--nproc", "2", "--accum", "2"]}


def train(tmp: Path, name: str, world: int, *extra: str) -> tuple[Path, Path, str]:
    ckpt, run_dir = tmp / f"{name}-ck", tmp / f"{name}-run"
    done = run_cli(["train", *FAST, *STEPS, *WORLDS[world], "--ckpt-dir", str(ckpt), "--run-dir", str(run_dir),
                    *extra])
    assert done.returncode == 0, done.stdout + done.stderr
    return ckpt, run_dir, done.stdout


def params(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = tmp / f"{checkpoint.parent.name}-{checkpoint.name}.safetensors"
    export(checkpoint, out)
    return load_file(out)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, tuple[Path, Path]]:
    tmp = tmp_path_factory.mktemp("resize")
    return {world: train(tmp, f"uninterrupted{world}", world)[:2] for world in WORLDS}


@pytest.mark.parametrize("saved,now", [(4, 2), (2, 4)], ids=["shrink-4-to-2", "grow-2-to-4"])
def test_resume_on_another_world_keeps_the_global_batch(tmp_path, references, saved, now):
    source = references[saved][0] / "step-00000002"
    shutil.copytree(source, tmp_path / "resumed-ck" / source.name)
    shutil.copytree(references[saved][1], tmp_path / "resumed-run")  # a relaunch keeps its run dir
    # The same command line as the saved run (as torchrun relaunches it), on the new world.
    ckpt, run_dir, out = train(tmp_path, "resumed", now, "--resume", "auto", "--nproc", str(now),
                               "--accum", WORLDS[saved][-1])
    accum = int(WORLDS[now][-1])
    assert f"resized from {saved} to {now} data-parallel ranks at step 2: accumulation {WORLDS[saved][-1]} -> " \
           f"{accum} keeps the global batch of 8" in out, out

    reference_ck, reference_run = references[now]
    update = max_diff(params(reference_ck / "step-00000003", tmp_path), params(ckpt / "step-00000003", tmp_path))
    ours, theirs = read_metrics(run_dir), read_metrics(reference_run)
    losses = max(abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs))
    print(f"{saved} -> {now} ranks: next update max|param diff| {update:.1e} against the uninterrupted run at "
          f"{now} ranks; loss max|diff| over the 4 steps {losses:.1e}")
    assert update <= TOL and losses <= TOL, "the loss curve continues with no jump"
    assert [m["step"] for m in ours] == [1, 2, 3, 4]
    assert all("world" not in m for m in ours[:2]), "the steps before the resize ran as saved"
    assert [(m["world"], m["accum"]) for m in ours[2:]] == [(now, accum)] * 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resize"] == {"at_step": 2, "batch": 8, "from_world": saved, "to_world": now,
                                 "from_accum": int(WORLDS[saved][-1]), "to_accum": accum, "micro_batch": 2,
                                 "from_microbatches": 1, "to_microbatches": 1}  # no pipeline either side


def test_a_world_that_cannot_keep_the_global_batch_is_refused_before_launch(tmp_path, references):
    source = references[2][0] / "step-00000002"
    shutil.copytree(source, tmp_path / "ck" / source.name)
    refused = run_cli(["train", *FAST, *STEPS, "--nproc", "3", "--ckpt-dir", str(tmp_path / "ck"),
                       "--run-dir", str(tmp_path / "run"), "--resume", "auto"])
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    line = next(line for line in refused.stderr.splitlines() if "error" in line)
    assert "batch=8" in line and "3 ranks" in line, line
    assert not (tmp_path / "run").exists(), "refused before any rank started"
