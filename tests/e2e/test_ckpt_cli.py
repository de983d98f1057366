"""Checkpoints through the CLI: a rank killed with SIGKILL mid-save, then `--resume auto`.

Two `zeroshard train` runs (about 6 s each on two cores) and offline `zeroshard ckpt` calls.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from test_cli import FAST, read_metrics, run_cli, run_main

TRAIN = ["train", *FAST, "--nproc", "2", "--steps", "6", "--warmup", "2", "--save-every", "2"]


def test_kill9_mid_save_keeps_previous_checkpoint_and_resume_auto_uses_it(tmp_path: Path, capsys) -> None:
    ckpt, run_dir = tmp_path / "ck", tmp_path / "run"
    args = [*TRAIN, "--ckpt-dir", str(ckpt), "--run-dir", str(run_dir)]
    # Rank 1 SIGKILLs itself halfway through writing its file for the step-4 checkpoint.
    killed = run_cli(args, env={"ZEROSHARD_CKPT_FAULT": "rank=1,step=4"})
    assert killed.returncode != 0, killed.stdout + killed.stderr
    before = {m["step"]: m["loss"] for m in read_metrics(run_dir)}
    assert sorted(before) == [1, 2, 3, 4]

    partial = ckpt / ".step-00000004.partial"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    assert not (ckpt / "step-00000004").exists()
    assert (ckpt / "latest").read_text().strip() == "step-00000002"
    verified = run_cli(["ckpt", "verify", str(ckpt)])
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "OK" in verified.stdout and "step-00000002" in verified.stdout and "interrupted" in verified.stdout

    resumed = run_cli([*args, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "skipped" in resumed.stdout and ".step-00000004.partial" in resumed.stdout
    assert "resumed from" in resumed.stdout and "step-00000002 at step 2" in resumed.stdout
    after = read_metrics(run_dir)
    assert [m["step"] for m in after] == [1, 2, 3, 4, 5, 6], "each step once, the abandoned attempt dropped"
    # Steps 3 and 4 ran twice, before the kill and after the resume: bitwise the same losses.
    assert [after[2]["loss"], after[3]["loss"]] == [before[3], before[4]]

    # Offline: in this process (an interpreter start less); `ckpt verify` above runs as a subprocess.
    info = run_main(["ckpt", "inspect", "--json", str(ckpt)], capsys)
    assert info.returncode == 0, info.stderr
    summary = json.loads(info.stdout)
    assert summary["step"] == 6 and summary["world"] == 2 and summary["sampler"]["step"] == 6 % (256 // 8)
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "latest", "step-00000002", "step-00000004", "step-00000006"]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_damaged_manifests_refuse_resume_and_nothing_is_deleted(tmp_path: Path) -> None:
    """The data-loss case: both checkpoints' manifest.json truncated (a full disk, a sync tool),
    the rank files intact. `--resume auto --keep-last 2` must refuse, naming both, and touch nothing."""
    whole, run_dir = tmp_path / "whole", tmp_path / "run"
    done = run_cli([*TRAIN, "--ckpt-dir", str(whole), "--run-dir", str(run_dir), "--keep-last", "0"])
    assert done.returncode == 0, done.stdout + done.stderr

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in ("step-00000002", "step-00000004"):
        shutil.copytree(whole / name, damaged / name)
        manifest = damaged / name / "manifest.json"
        manifest.write_bytes(manifest.read_bytes()[:100])
    before = _tree(damaged)

    refused = run_cli([*TRAIN, "--ckpt-dir", str(damaged), "--run-dir", str(tmp_path / "run2"), "--resume", "auto",
                       "--keep-last", "2"])
    assert refused.returncode != 0, refused.stdout + refused.stderr
    error = [line for line in refused.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "step-00000002" in error[0] and "step-00000004" in error[0], refused.stderr
    assert "not valid JSON" in error[0] and "--resume fresh-ok" in error[0] and "ckpt repair" in error[0]
    assert "Traceback" not in refused.stderr
    assert _tree(damaged) == before, "a refused resume deletes, renames and writes nothing"
