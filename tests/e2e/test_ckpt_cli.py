"""Checkpoints through the CLI: a rank killed with SIGKILL mid-save, then `--resume auto`.

Two `zeroshard train` runs (about 6 s each on two cores) and offline `zeroshard ckpt` calls.
"""

from __future__ import annotations

import json
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
