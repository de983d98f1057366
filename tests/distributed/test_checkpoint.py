"""Sharded checkpoints: bitwise resume, resize 4 -> 2 and 4 -> 1, corruption, path safety, export.

One world-4 spawn saves at every stage; each resume is a fresh spawn (a new process group). The
world-2 resume also checks the errors every rank must raise, and the world-1 resume also writes the
checkpoint of the export memory test, so the module starts four gloo worlds.
The kill -9 mid-save case runs through the CLI in tests/e2e/test_ckpt_cli.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ckpt_workloads as cw
import zeroshard as zs
from zeroshard.checkpoint import CheckpointError, export, problems, verify
from zeroshard.checkpoint import format as fmt
from zeroshard.cli.main import main as cli
from zeroshard.trainer.launch import spawn
from zeroshard.models import GPT, GPTConfig

RESIZE_TOL = 1e-5  # the stage-0 tolerance of the parity tests
RESIZE_CASES = {2: [(3, 2), (0, 0)], 1: [(3, 0)]}  # world -> [(saved stage, stage now)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return root, spawn(cw.save_world, 4, args=(str(root),), timeout_s=300)[0]


@pytest.fixture(scope="module")
def resumed_same_world(saved):
    root, _ = saved
    return spawn(cw.resume_world, 4, args=(str(root), [(s, s) for s in cw.SAVED_STAGES]), timeout_s=300)[0]


@pytest.fixture(scope="module")
def corrupt_stage0(saved, tmp_path_factory) -> Path:
    """A copy of the stage-0 checkpoint with a byte of rank 0's file flipped."""
    root, _ = saved
    bad = _copy(root, tmp_path_factory.mktemp("corrupt"), "corrupt-for-world")
    target = bad / fmt.rank_file(0)
    data = bytearray(target.read_bytes())
    data[-5] ^= 0xFF
    target.write_bytes(data)
    return bad


@pytest.fixture(scope="module")
def resized2(saved, corrupt_stage0):
    root, _ = saved
    return spawn(cw.resume_world_and, 2, args=(str(root), RESIZE_CASES[2], {"corrupt": str(corrupt_stage0)}),
                 timeout_s=300)[0]


@pytest.fixture(scope="module")
def small_source(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export") / "small"


@pytest.fixture(scope="module")
def resized1(saved, small_source):
    root, _ = saved
    return spawn(cw.resume_world_and, 1, args=(str(root), RESIZE_CASES[1], {"small": str(small_source)}),
                 timeout_s=300)[0]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("stage", cw.SAVED_STAGES)
def test_resume_same_world_is_bitwise(saved, resumed_same_world, stage):
    _, results = saved
    a, first, second = results[("continuous", stage)], results[("first_half", stage)], resumed_same_world[(stage, stage)]
    print(f"stage {stage}: max|param A - B| = {max_diff(a['params'], second['params']):.1e}")
    assert second["step"] == cw.K and second["saved_world"] == 4 and second["extra"] == {"note": "first half"}
    assert first["losses"] + second["losses"] == a["losses"]
    assert all(torch.equal(a["params"][k], second["params"][k]) for k in a["params"])
    assert first["consumed"] + second["consumed"] == a["consumed"], "data order must continue exactly"


@pytest.mark.parametrize("world", [2, 1], ids=lambda w: f"world{w}")
def test_resize_next_update_and_data_order(request, saved, world):
    _, results = saved
    cases = request.getfixturevalue(f"resized{world}")["resume"]
    for (saved_stage, stage), run in cases.items():
        a = results[("continuous", saved_stage)]
        update = max_diff(a["after_first"], run["after_first"])
        losses = max(abs(x - y) for x, y in zip(a["losses"][cw.K:], run["losses"]))
        print(f"4 ranks stage {saved_stage} -> {world} ranks stage {stage}: next update max|diff| {update:.1e}, "
              f"loss max|diff| {losses:.1e}, params after {cw.K} more steps {max_diff(a['params'], run['params']):.1e}")
        assert update <= RESIZE_TOL and losses <= RESIZE_TOL
        # Same global batches in the same order: nothing repeated, nothing skipped.
        assert run["consumed"] == a["consumed"][cw.K:]
        assert run["lr_after"] == pytest.approx([cw.LR * cw.lr_lambda(2 * cw.K)] * 2, rel=1e-12)


def test_files_are_safetensors_and_json_only(saved):
    root, _ = saved
    directory = zs.checkpoint.resolve(root / "stage3")
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["manifest.json"] + [fmt.rank_file(r) for r in range(4)]
    manifest = verify(directory)
    assert manifest["world"] == 4 and manifest["stage"] == 3 and manifest["step"] == cw.K
    assert manifest["sampler"]["step"] == cw.K and manifest["scheduler"]["last_epoch"] == cw.K
    assert manifest["model"]["config"]["n_embd"] == 64 and manifest["precision"] is not None
    tied = next(p for p in manifest["params"] if p["fqn"] == "tok_emb.weight")
    assert tied["aliases"] == ["tok_emb.weight", "lm_head.weight"], "one entry for the tied weight"
    state = safetensors.torch.load_file(directory / fmt.rank_file(1))  # the reference reader opens ours
    assert any(k.startswith("optim.exp_avg/") for k in state)


def test_plain_model_load_and_export_equal_gathered_params(saved, tmp_path):
    root, results = saved
    gathered = results[("first_half", 3)]["params"]
    plain = GPT(GPTConfig.named("tiny", seq_len=cw.SEQ_LEN))
    zs.load(root / "stage3", plain)
    assert all(torch.equal(plain.state_dict()[k], gathered[k]) for k in gathered)
    out = tmp_path / "full.safetensors"
    export(root / "stage3", out)
    fresh = GPT(GPTConfig.named("tiny", seq_len=cw.SEQ_LEN))
    fresh.load_state_dict(safetensors.torch.load_file(out))
    assert all(torch.equal(fresh.state_dict()[k], gathered[k]) for k in gathered)


def _copy(root: Path, tmp_path: Path, name: str) -> Path:
    src = zs.checkpoint.resolve(root / "stage0")
    return Path(shutil.copytree(src, tmp_path / name))


def test_flipped_byte_is_named_by_verify_and_load(saved, tmp_path, capsys):
    root, _ = saved
    bad = _copy(root, tmp_path, "flipped")
    target = bad / fmt.rank_file(2)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(data)
    assert cli(["ckpt", "verify", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and fmt.rank_file(2) in out and "corrupt" in out
    assert fmt.rank_file(1) not in out, "only the damaged file is named"
    with pytest.raises(CheckpointError, match=fmt.rank_file(2)):
        zs.load(bad, GPT(GPTConfig.named("tiny", seq_len=cw.SEQ_LEN)))


def test_truncated_and_missing_files_are_named(saved, tmp_path):
    root, _ = saved
    bad = _copy(root, tmp_path, "truncated")
    target = bad / fmt.rank_file(3)
    target.write_bytes(target.read_bytes()[:1000])
    assert any("truncated" in p and fmt.rank_file(3) in p for p in problems(bad))
    target.unlink()
    assert any("missing" in p and fmt.rank_file(3) in p for p in problems(bad))


def _edit_manifest(directory: Path, edit, *, reseal: bool) -> None:
    manifest = json.loads((directory / fmt.MANIFEST).read_text())
    edit(manifest)
    if reseal:  # an attacker (or a buggy tool) that also fixes the manifest's own digest
        manifest.pop("manifest_sha256")
        fmt.write_manifest(directory, manifest)
    else:
        (directory / fmt.MANIFEST).write_text(json.dumps(manifest))


def test_manifest_path_escaping_the_directory_is_refused(saved, tmp_path):
    root, _ = saved
    (tmp_path / "evil.safetensors").write_bytes(b"not a checkpoint")

    def escape(manifest):
        manifest["params"][0]["pieces"][0]["file"] = "../evil.safetensors"

    bad = _copy(root, tmp_path, "escape")
    _edit_manifest(bad, escape, reseal=False)
    with pytest.raises(CheckpointError, match="manifest checksum mismatch"):
        verify(bad)
    _edit_manifest(bad, escape, reseal=True)
    for call in (lambda: verify(bad), lambda: zs.load(bad, GPT(GPTConfig.named("tiny", seq_len=cw.SEQ_LEN)))):
        with pytest.raises(CheckpointError, match=r"'\.\./evil\.safetensors'.*not a plain file name"):
            call()


def test_errors_reach_every_rank_and_name_the_cause(resized2):
    errors = resized2["errors"]
    assert "shape" in errors["shape"] and "n_embd" not in errors["shape"] and "different model" in errors["shape"]
    assert fmt.rank_file(0) in errors["corrupt"] and "corrupt" in errors["corrupt"]
    assert "already exists" in errors["exists"] and "overwrite=True" in errors["exists"]


def test_export_streams_one_param_at_a_time(resized1, small_source, tmp_path):
    """Peak memory of a full export is about the largest param, not the model."""
    here = Path(__file__).parent
    src, out = small_source, tmp_path / "small.safetensors"
    model = resized1["small"]
    code = (f"import json, sys; sys.path.insert(0, {str(here)!r}); import ckpt_workloads as cw; "
            f"print(json.dumps(cw.export_peak({str(src)!r}, {str(out)!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    peak = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"export of {model['model_bytes'] / 2**20:.1f} MiB model: peak RSS rise {peak['peak_rise_bytes'] / 2**20:.1f} "
          f"MiB, largest param {model['largest_param_bytes'] / 2**20:.1f} MiB")
    assert peak["peak_rise_bytes"] < model["model_bytes"] / 4
