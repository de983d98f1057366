"""Checkpoint format pieces that need no process group: files, JSON, path safety, discovery, config."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch

from zeroshard.checkpoint import CheckpointError, choose
from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.pieces import split_range
from zeroshard.checkpoint.tensorfile import Entry, TensorFile, TensorFileWriter, file_sha256
from zeroshard.checkpoint.training import TrainingCheckpoints
from zeroshard.trainer.config import TrainConfig


def write(path: Path, tensors: dict[str, torch.Tensor], metadata=None) -> tuple[str, int]:
    writer = TensorFileWriter(path, [Entry(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], metadata)
    for k, v in tensors.items():
        writer.write(k, v)
    return writer.close()


def test_streamed_file_is_plain_safetensors_and_ranged_reads_work(tmp_path):
    base = torch.arange(100, dtype=torch.float32)
    tensors = {"a": base[10:30], "b": base[25:40].to(torch.bfloat16).view(3, 5), "empty": base[:0],
               "flag": torch.tensor([True, False])}  # "a" and "b" share storage: fine for our writer
    digest, size = write(tmp_path / "x.safetensors", tensors, {"k": "v"})
    assert (digest, size) == file_sha256(tmp_path / "x.safetensors")
    loaded = safetensors.torch.load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    opened = TensorFile(tmp_path / "x.safetensors")
    assert opened.metadata == {"k": "v"}
    out = torch.zeros(5)
    opened.read_into("a", 3, out)
    assert torch.equal(out, base[13:18])
    with pytest.raises(CheckpointError, match="outside a"):
        opened.read_into("a", 18, out)


def test_truncated_file_is_named(tmp_path):
    write(tmp_path / "t.safetensors", {"a": torch.ones(1000)})
    raw = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match=r"t\.safetensors is truncated"):
        TensorFile(tmp_path / "t.safetensors")


@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/passwd", "a/b", "..", ".hidden", "", 3, "a\nb"])
def test_unsafe_member_names_are_refused(tmp_path, name):
    with pytest.raises(CheckpointError, match="not a plain file name"):
        fmt.safe_member(tmp_path, name, "test")


def test_json_codec_round_trips_tuples_tensors_and_int_keys():
    value = {"betas": (0.9, 0.95), "step": torch.tensor(3.0), 5: [1, (2, 3)], "none": None}
    back = fmt.from_json(json.loads(json.dumps(fmt.to_json(value, "x"))))
    assert back["betas"] == (0.9, 0.95) and back[5] == [1, (2, 3)] and back["none"] is None
    assert back["step"].dtype == torch.float32 and back["step"].item() == 3.0
    with pytest.raises(CheckpointError, match="scheduler.state_dict.*object"):
        fmt.to_json({"fn": object()}, "scheduler.state_dict()")


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_split_range_tiles_the_shard(parts):
    ranges = [split_range(128, 128 + 64 * 10, parts, i) for i in range(parts)]
    assert ranges[0][0] == 128 and ranges[-1][1] == 128 + 640
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def _fake_checkpoint(root: Path, name: str, step: int, lineage: str | None = None) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    digest, size = write(directory / fmt.rank_file(0), {"master/w@0:4": torch.ones(4)})
    manifest = {
        "format": fmt.FORMAT, "version": fmt.VERSION, "step": step, "world": 1, "stage": 0,
        "params": [{"fqn": "w", "aliases": ["w"], "shape": [4], "dtype": "float32", "trainable": True,
                    "param_group": None, "state": [],
                    "pieces": [{"file": fmt.rank_file(0), "start": 0, "stop": 4}]}],
        "buffers": [], "groups": [], "ranks": [{"rank": 0, "file": fmt.rank_file(0)}],
        "files": {fmt.rank_file(0): {"sha256": digest, "bytes": size}}, "lineage": lineage,
    }
    fmt.write_manifest(directory, manifest)
    return directory


def test_choose_skips_newer_broken_and_interrupted_checkpoints(tmp_path):
    _fake_checkpoint(tmp_path, "step-2", 2)
    broken = _fake_checkpoint(tmp_path, "step-4", 4)
    (broken / fmt.rank_file(0)).write_bytes(b"\0" * (broken / fmt.rank_file(0)).stat().st_size)
    (tmp_path / ".step-6.partial").mkdir()
    choice = choose(tmp_path)
    assert choice.path == tmp_path / "step-2" and choice.step == 2
    reasons = dict(choice.skipped)
    assert "interrupted" in reasons[tmp_path / ".step-6.partial"]
    assert "rank-00000.safetensors is corrupt" in reasons[broken]
    assert [p for p, _ in choice.faults] == [broken], "an interrupted save is no fault: it never committed"


def test_fresh_run_refuses_a_ckpt_dir_that_holds_checkpoints(tmp_path):
    _fake_checkpoint(tmp_path, "step-2", 2)
    cfg = TrainConfig(save_every=2, ckpt_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match="--resume auto"):
        TrainingCheckpoints(SimpleNamespace(cfg=cfg, mesh=SimpleNamespace(rank=0))).resume()


def test_config_checks_checkpoint_flags():
    with pytest.raises(ValueError, match="needs ckpt_dir"):
        TrainConfig(save_every=5)
    with pytest.raises(ValueError, match="resume='auto'"):
        TrainConfig(resume="auto")
    with pytest.raises(ValueError, match="keep_last=-1"):
        TrainConfig(keep_last=-1)


def test_the_latest_pointer_file_itself_names_the_checkpoint(tmp_path):
    from zeroshard.checkpoint.save import write_latest
    from zeroshard.checkpoint.verify import resolve

    step = _fake_checkpoint(tmp_path, "step-2", 2)
    write_latest(step)
    assert resolve(tmp_path) == step and resolve(tmp_path / fmt.LATEST) == step
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        resolve(tmp_path / "step-9")
