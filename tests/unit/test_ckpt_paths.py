"""Every `zeroshard ckpt` action reads a path by one rule (zeroshard/checkpoint/discover.py `named`):
the `latest` pointer file, the root that holds it and the checkpoint directory name the same
checkpoint. The README's `zeroshard ckpt verify ckpt/latest` once failed while `inspect` and `export`
read the pointer. A real checkpoint, made offline (dcp.save without a process group, then
`ckpt import-dcp`), so no rank is spawned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

from zeroshard.checkpoint.save import write_latest
from zeroshard.cli.main import main as cli

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A root `ck` holding one complete checkpoint, step-00000001, and the `latest` pointer to it."""
    work = tmp_path_factory.mktemp("ckpt_paths")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    dcp.save({"model": model.state_dict()}, checkpoint_id=work / "dcp", no_dist=True)
    ck = work / "ck"
    ck.mkdir()
    assert cli(["ckpt", "import-dcp", str(work / "dcp"), str(ck / "step-00000001"), "--no-optimizer"]) == 0
    write_latest(ck / "step-00000001")
    return ck


def spellings(ck: Path) -> dict[str, str]:
    return {"pointer": str(ck / "latest"), "root": str(ck), "directory": str(ck / "step-00000001")}


@pytest.mark.parametrize("spelling", ["pointer", "root", "directory"])
def test_verify_reads_the_latest_pointer_as_every_other_action_does(root: Path, spelling: str, capsys) -> None:
    capsys.readouterr()
    rc = cli(["ckpt", "verify", spellings(root)[spelling]])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.splitlines() == [f"OK   {root / 'step-00000001'}"]


@pytest.mark.parametrize("spelling", ["pointer", "root", "directory"])
def test_inspect_export_reshard_and_export_dcp_name_the_same_checkpoint(root: Path, spelling: str, tmp_path: Path,
                                                                          capsys) -> None:
    path = spellings(root)[spelling]
    capsys.readouterr()
    assert cli(["ckpt", "inspect", "--json", path]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(root / "step-00000001")
    assert cli(["ckpt", "export", path, str(tmp_path / "full.safetensors")]) == 0
    assert sorted(load_file(tmp_path / "full.safetensors")) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert cli(["ckpt", "reshard", path, str(tmp_path / "two"), "-w", "2"]) == 0
    assert cli(["ckpt", "verify", str(tmp_path / "two")]) == 0
    assert cli(["ckpt", "export-dcp", path, str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / ".metadata").is_file()
    assert cli(["ckpt", "repair", path]) == 0
    assert f"OK       {root / 'step-00000001'}: verifies" in capsys.readouterr().out


def test_a_missing_path_and_a_lost_manifest_in_a_root_fail_verify_by_name(root: Path, tmp_path: Path,
                                                                           capsys) -> None:
    capsys.readouterr()
    assert cli(["ckpt", "verify", str(tmp_path / "nowhere")]) == 1
    assert f"FAIL {tmp_path / 'nowhere'}: no checkpoint at" in capsys.readouterr().out
    # A root whose one checkpoint lost its manifest: verify of the root names it (as repair and
    # `--resume auto` do) rather than passing over it.
    lost = tmp_path / "ck" / "step-00000002"
    lost.mkdir(parents=True)
    (lost / "rank-00000.safetensors").write_bytes((root / "step-00000001" / "rank-00000.safetensors").read_bytes())
    assert cli(["ckpt", "verify", str(tmp_path / "ck")]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {lost}" in out and "manifest.json" in out
    assert cli(["ckpt", "inspect", str(tmp_path / "ck")]) == 1
    assert "no manifest.json and no latest pointer" in capsys.readouterr().err
