"""Asynchronous save on one in-process rank: the background save commits a checkpoint equal to a
synchronous one, at most one is in flight, and its host copy is the planner's figure."""

from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from zeroshard.checkpoint import async_save, rankfile, verify
from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.pieces import persistent_buffers
from zeroshard.checkpoint.tensorfile import TensorFile
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import get_engine


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    zs.init()
    yield
    zs.shutdown()


def trained(stage: int):
    torch.manual_seed(0)
    model = zs.shard(GPT(GPTConfig.named("tiny", seq_len=16)), stage=stage)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-3)
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def tensors(directory) -> dict[str, torch.Tensor]:
    opened = TensorFile(directory / fmt.rank_file(0))
    try:
        return {name: opened.read(name) for name in opened.tensors}
    finally:
        opened.close()


def test_background_save_commits_the_state_of_the_moment_it_returned(tmp_path):
    model, opt = trained(stage=3)
    zs.save(tmp_path / "sync", model, opt, step=1)
    pending = zs.save(tmp_path / "async", model, opt, step=1, async_=True)
    assert async_save.in_flight() is pending
    with torch.no_grad():  # training goes on at once: the save holds its own copy
        for p in opt.param_groups[0]["params"]:
            p.add_(1.0)
    assert pending.wait() == tmp_path / "async" and pending.done()
    assert verify(tmp_path / "async")["step"] == 1
    a, b = tensors(tmp_path / "sync"), tensors(tmp_path / "async")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_next_save_waits_for_the_one_in_flight(tmp_path):
    model, opt = trained(stage=1)
    first = zs.save(tmp_path / "one", model, opt, step=1, async_=True)
    second = zs.save(tmp_path / "two", model, opt, step=2, async_=True)
    assert first.done(), "a save starts only once the previous one has finished"
    assert second.wait() == tmp_path / "two" and verify(tmp_path / "one")["step"] == 1
    zs.save(tmp_path / "three", model, opt, step=3)  # a synchronous one waits too
    assert verify(tmp_path / "three")["step"] == 3 and async_save.in_flight() is None


def test_a_failed_background_write_is_raised_by_the_next_save_and_commits_nothing(tmp_path, monkeypatch):
    model, opt = trained(stage=2)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rankfile, "write", disk_full)
    pending = zs.save(tmp_path / "ck", model, opt, step=1, async_=True)
    with pytest.raises(zs.CheckpointError, match="No space left"):
        pending.wait()
    assert not (tmp_path / "ck").exists() and (tmp_path / ".ck.partial").is_dir()
    monkeypatch.undo()
    with pytest.raises(zs.CheckpointError, match="previous asynchronous save .* failed on rank 0"):
        zs.save(tmp_path / "next", model, opt, step=2, async_=True)
    assert async_save.in_flight() is None, "a failure is reported once"


def test_host_copy_is_the_planners_checkpoint_host_bytes():
    model, opt = trained(stage=0)
    pieces = rankfile.collect(model, get_engine(model), opt)
    snapshot = async_save.HostSnapshot()
    snapshot.take(pieces)
    planned = zs.plan(GPTConfig.named("tiny", seq_len=16), world=1, device="cpu").checkpoint_host_bytes
    buffers = sum(b.numel() * b.element_size() for _, b in persistent_buffers(model))  # not planned: tiny
    print(f"async save host copy {snapshot.nbytes:,} B (pieces {pieces.nbytes:,} B), planner {planned:,} B")
    assert planned == pieces.nbytes - buffers and snapshot.nbytes >= pieces.nbytes
