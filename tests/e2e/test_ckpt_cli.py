"""Checkpoints through the CLI: a rank killed with SIGKILL mid-save, then `--resume auto`; damaged
manifests, a refused resume, `ckpt repair` and a bitwise resume from the repaired checkpoints.

`zeroshard train` runs of a few seconds each on two cores, and offline `zeroshard ckpt` calls.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

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


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every rank file (read without pickle)."""
    return {f"{f.name}:{k}": v for f in sorted(checkpoint.glob("rank-*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The checkpoint directory of TRAIN run without interruption, every checkpoint kept."""
    root = tmp_path_factory.mktemp("uninterrupted")
    done = run_cli([*TRAIN, "--ckpt-dir", str(root / "ck"), "--run-dir", str(root / "run"), "--keep-last", "0"])
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "ck"


def test_damaged_manifests_refuse_resume_then_repair_resumes_bitwise(tmp_path: Path, capsys, uninterrupted) -> None:
    """The data-loss case: both checkpoints' manifest.json truncated (a full disk, a sync tool),
    the rank files intact. `--resume auto --keep-last 2` must refuse, naming both, and touch nothing;
    `ckpt repair` rebuilds both manifests, and the resumed run ends bitwise equal to an uninterrupted one."""
    whole = uninterrupted

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in ("step-00000002", "step-00000004"):
        shutil.copytree(whole / name, damaged / name)
        manifest = damaged / name / "manifest.json"
        manifest.write_bytes(manifest.read_bytes()[:100])
    before = _tree(damaged)
    resume = [*TRAIN, "--ckpt-dir", str(damaged), "--run-dir", str(tmp_path / "run2"), "--resume", "auto",
              "--keep-last", "2"]

    refused = run_cli(resume)
    assert refused.returncode != 0, refused.stdout + refused.stderr
    error = [line for line in refused.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "step-00000002" in error[0] and "step-00000004" in error[0], refused.stderr
    assert "not valid JSON" in error[0] and "--resume fresh-ok" in error[0] and "ckpt repair" in error[0]
    assert "Traceback" not in refused.stderr
    assert _tree(damaged) == before, "a refused resume deletes, renames and writes nothing"

    repaired = run_main(["ckpt", "repair", str(damaged)], capsys)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert repaired.stdout.count("REPAIRED") == 2 and "manifest.json.damaged" in repaired.stdout
    for name in ("step-00000002", "step-00000004"):
        rebuilt = json.loads((damaged / name / "manifest.json").read_text())
        assert rebuilt == json.loads((whole / name / "manifest.json").read_text()), "the manifest as saved"
        assert (damaged / name / "manifest.json.damaged").read_bytes() == before[f"{name}/manifest.json"]

    resumed = run_cli(resume)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "step-00000004 at step 4" in resumed.stdout
    assert sorted(p.name for p in damaged.iterdir() if p.is_dir()) == ["step-00000004", "step-00000006"]
    assert "rotated out" in resumed.stdout and "damaged/step-00000002" in resumed.stdout  # verified, same lineage
    a, b = (_tensors(root / "step-00000006") for root in (whole, damaged))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "masters and optimizer state bitwise"

    # A damaged rank file cannot be salvaged: repair names it and writes nothing.
    lost = shutil.copytree(whole / "step-00000006", tmp_path / "lost" / "step-00000006")
    (lost / "manifest.json").unlink()
    victim = lost / "rank-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10  # a flipped bit in the last tensor's data
    victim.write_bytes(data)
    before = _tree(lost.parent)
    refused = run_main(["ckpt", "repair", str(lost.parent)], capsys)
    assert refused.returncode == 1
    assert "rank-00001.safetensors is damaged" in refused.stderr and "cannot be salvaged" in refused.stderr
    assert _tree(lost.parent) == before


def test_async_save_killed_mid_background_write_resumes_from_previous_bitwise(tmp_path: Path, uninterrupted) -> None:
    """--save-async: rank 1 SIGKILLs itself halfway through writing its step-4 file on the background
    thread, while training goes on. The step-2 checkpoint stays the newest committed; the resumed
    run (async too) ends bitwise equal to the uninterrupted synchronous one."""
    ckpt, run_dir = tmp_path / "ck", tmp_path / "run"
    args = [*TRAIN, "--ckpt-dir", str(ckpt), "--run-dir", str(run_dir), "--save-async"]
    killed = run_cli(args, env={"ZEROSHARD_CKPT_FAULT": "rank=1,step=4"})
    assert killed.returncode != 0, killed.stdout + killed.stderr
    assert (ckpt / ".step-00000004.partial").is_dir() and not (ckpt / "step-00000004").exists()
    assert (ckpt / "latest").read_text().strip() == "step-00000002"

    resumed = run_cli([*args, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "step-00000002 at step 2" in resumed.stdout
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    a, b = (_tensors(root / "step-00000006") for root in (uninterrupted, ckpt))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "masters and optimizer state bitwise"
