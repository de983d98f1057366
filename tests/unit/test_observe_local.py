"""zs.observe in one process: loggers' names and errors, the user-collective wrappers (recorded, and
put back), an observed loop's files, a failure's dump with stacks, and the doctor's "where each rank
was" on synthetic dumps. The two-rank runs are in tests/e2e/test_observe.py."""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard as zs
from zeroshard.comm import collectives
from zeroshard.observing.doctor import analyse, render
from zeroshard.comm.ledger import read_dump
from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.observing.loggers import check_installed, parse_log, scalars
from zeroshard.observing.usercalls import UserCollectives


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    zs.init()


def test_parse_log_and_missing_packages(monkeypatch):
    assert parse_log("tensorboard, wandb") == ("tensorboard", "wandb")
    assert parse_log(["wandb"]) == ("wandb",) and parse_log("none") == () and parse_log(None) == ()
    with pytest.raises(ValueError, match=r"^unknown logger 'tb': choose from tensorboard, wandb \(comma-separated\)$"):
        parse_log("tb")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    for name in ("tensorboard", "wandb"):
        with pytest.raises(ValueError, match=rf"^log='{name}' needs the {name} package, which is not installed: "
                                             r"pip install 'zeroshard\[log\]'$"):
            check_installed([name])
    with pytest.raises(ValueError, match="zeroshard\\[log\\]"):
        zs.observe("unused", log="tensorboard")  # refused when built, before anything starts


def test_scalars_are_the_record_numbers():
    record = {"step": 2, "loss": 1.5, "lr": 1e-3, "grad_norm": None, "step_time_s": 0.5, "tokens": 64,
              "tokens_per_s": 128.0, "loss_scale": None, "accuracy": 0.25, "note": "text",
              "profile": {"mfu": 0.1, "mem_peak_mb": 12.0, "comm_bytes": 4096, "comm_exposed_s": 0.01, "overlap": None}}
    assert scalars(record) == {
        "train/loss": 1.5, "train/lr": 1e-3, "perf/step_time_s": 0.5, "perf/tokens_per_s": 128.0, "perf/mfu": 0.1,
        "memory/peak_mb": 12.0, "comm/bytes": 4096.0, "comm/exposed_s": 0.01, "train/accuracy": 0.25}


def test_user_collectives_are_recorded_with_their_line_and_the_wrappers_are_put_back():
    original = dist.all_reduce
    ledger = zs.ledger()
    with UserCollectives() as calls:
        assert dist.all_reduce is not original
        before = ledger.next_seq
        t = torch.ones(3)
        dist.all_reduce(t)
        line = inspect.currentframe().f_lineno - 1
        collectives.all_reduce(t, phase="metrics")  # zeroshard's own call: recorded once, as ours
    assert dist.all_reduce is original
    records = ledger.since(before)
    assert [(r.op, r.phase, r.numel) for r in records] == [("all_reduce", "user", 3), ("all_reduce", "metrics", 3)]
    assert records[0].state.value == "completed" and records[0].wait_start is not None
    assert calls.calls == {before: f"{os.path.relpath(__file__)}:{line} in "
                                   "test_user_collectives_are_recorded_with_their_line_and_the_wrappers_are_put_back"}


def test_a_function_replaced_by_someone_else_meanwhile_is_left_to_them():
    original_barrier, original_reduce = dist.barrier, dist.all_reduce

    def theirs(*args, **kwargs):
        return None

    wrappers = UserCollectives()
    wrappers.__enter__()
    dist.barrier = theirs
    try:
        wrappers.__exit__(None, None, None)
        assert dist.barrier is theirs and dist.all_reduce is original_reduce
    finally:
        dist.barrier = original_barrier


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = GPT(GPTConfig.named("tiny", vocab_size=32, seq_len=16))
    zs.shard(model, stage=3)
    return model


def test_observed_loop_writes_metrics_summary_and_a_finished_dump(tmp_path: Path):
    model = _tiny()
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-3)
    with zs.observe(tmp_path, model=model, hang_timeout_s=30, peak_flops=1e9, log="tensorboard") as obs:
        for step in range(3):
            x = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(step))
            loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec = obs.step(loss=loss, tokens=32, lr=1e-3, accuracy=0.5)
            assert rec["step"] == step + 1 and rec["loss"] == pytest.approx(float(loss.detach()))
    header, *lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert header["kind"] == "header" and header["topology"]["shape"] == "1 host x 1 rank"
    assert [m["step"] for m in lines] == [1, 2, 3] and lines[0]["accuracy"] == 0.5
    assert lines[1]["profile"]["tokens_per_s"] == pytest.approx(32 / lines[1]["profile"]["step_s"])
    assert lines[1]["profile"]["mfu"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["profile"]["profiled_steps"] == 2
    header, _ = read_dump(tmp_path / "ledger" / "rank-0.jsonl")
    assert header["reason"] == "finished" and "stacks" not in header
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_failure_inside_the_block_dumps_with_every_thread_stack_and_propagates(tmp_path: Path):
    model = _tiny()

    def broken_step():
        raise RuntimeError("boom in the loop")

    with pytest.raises(RuntimeError, match="boom"):
        with zs.observe(tmp_path, model=model, hang_timeout_s=30, profile=False):
            broken_step()
    header, _ = read_dump(tmp_path / "ledger" / "rank-0.jsonl")
    assert header["reason"] == "error" and "boom in the loop" in header["message"]
    main = next(t for t in header["stacks"] if t["main"])
    assert any("in test_a_failure_inside_the_block" in line for line in main["stack"])
    assert all(t["thread"] != "zeroshard-watchdog" for t in header["stacks"])


def test_one_observer_at_a_time(tmp_path: Path):
    with zs.observe(tmp_path / "a", profile=False):
        with pytest.raises(RuntimeError, match="already active in this process"):
            with zs.observe(tmp_path / "b", profile=False):
                pass
    with zs.observe(tmp_path / "c", profile=False):  # the first one's exit made room
        pass


def _dump(rank: int, reason: str, records: list[dict], stacks: list[dict] | None = None) -> tuple[dict, list[dict]]:
    header = {"rank": rank, "world": 2, "reason": reason, "message": "", "next_seq": len(records),
              "in_flight": [r["seq"] for r in records if r["state"] != "completed"]}
    if stacks is not None:
        header["stacks"] = stacks
    return header, records


def _rec(seq: int, state: str = "completed", **kw) -> dict:
    base = {"seq": seq, "op": "all_gather", "numel": 8, "dtype": "float32", "group": "shard", "unit": "blocks.0",
            "phase": "forward", "step": 2, "state": state, "wait_start": 1.0 if state != "completed" else None}
    return {**base, **kw}


def test_doctor_says_where_a_rank_blocked_outside_every_collective_was():
    stack = [{"thread": "MainThread", "main": True,
              "stack": ['  File "loop.py", line 9, in train\n    queue.get()']}]
    ranks = {
        0: _dump(0, "peer", [_rec(0), _rec(1)], stack),  # never entered #2: blocked elsewhere
        1: _dump(1, "hang", [_rec(0), _rec(1), _rec(2, "started", unit="blocks.1")], stack),
    }
    report = analyse(ranks)
    assert report["verdict"] == "never_entered"
    assert report["ranks"][0]["blocked"]["kind"] == "outside"
    text = "\n".join(render(report))
    assert "rank 0: blocked outside zeroshard's collectives (in none of them)" in text
    assert "queue.get()" in text
    assert "rank 1: waiting in collective #2 all_gather of unit blocks.1 in phase forward (step 2)" in text
