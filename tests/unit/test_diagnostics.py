"""The ledger's states and dumps, its crash-safe ring, the watchdog and the doctor's analysis,
on synthetic ledgers in one process (the real faults run in tests/e2e/test_diagnostics.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from zeroshard.comm import faults
from zeroshard.observing.doctor import analyse, load, render
from zeroshard.comm.ledger import CollectiveState, Ledger, read_dump
from zeroshard.observing.ring import RingMirror, read_ring
from zeroshard.observing.watchdog import Diagnostics, process_group_timeout


def _open(ledger: Ledger, unit: str = "blocks.0", numel: int = 64, op: str = "all_gather", phase: str = "forward"):
    return ledger.open(group="shard", op=op, numel=numel, dtype=torch.float32, elem_size=4, unit=unit, phase=phase)


def test_record_moves_scheduled_started_completed_and_leaves_in_flight():
    ledger = Ledger()
    record = _open(ledger)
    assert record.state is CollectiveState.SCHEDULED and ledger.in_flight() == [record]
    ledger.started(record)
    assert record.state is CollectiveState.STARTED
    ledger.wait_returned(record)
    assert record.state is CollectiveState.COMPLETED and record.end is not None and ledger.in_flight() == []


def test_stuck_counts_from_the_wait_not_from_the_issue():
    ledger = Ledger()
    record = _open(ledger)
    ledger.started(record)
    record.start -= 100  # issued long ago (a prefetch) but nobody waits on it: not a hang
    assert ledger.stuck(5.0) is None
    record.wait_start = time.perf_counter() - 10
    found, age = ledger.stuck(5.0)
    assert found is record and age >= 10


def test_device_async_records_stay_open_until_the_work_reports_completion(monkeypatch):
    from zeroshard.comm import ledger as ledger_module

    class Work:  # what NCCL gives: wait() only orders streams; is_completed() tells the truth
        done = False

        def is_completed(self) -> bool:
            return self.done

    ledger, work = Ledger(), Work()
    # After the wait, an event behind the collective on the stream stands for it (no CPU events).
    monkeypatch.setattr(ledger_module, "stream_marker", lambda: work)
    record = _open(ledger)
    ledger.started(record, work, device_async=True)
    ledger.wait_returned(record)
    assert record.state is CollectiveState.STARTED
    record.start -= 10
    assert ledger.stuck(5.0)[0] is record  # on the device it counts from the issue
    work.done = True
    ledger.poll()
    assert record.state is CollectiveState.COMPLETED and record.observed and ledger.stuck(5.0) is None


def test_hash_covers_unit_so_same_shaped_gathers_of_other_units_differ():
    a, b = Ledger(), Ledger()
    _open(a, unit="blocks.1")
    _open(b, unit="blocks.2")
    assert a.hash != b.hash
    c = Ledger()
    _open(c, unit="blocks.1")
    assert a.hash == c.hash


def test_an_uneven_all_to_all_agrees_across_ranks_that_sent_different_rows(tmp_path: Path):
    """Expert parallelism's token rows: each rank sends its own count, so numel is left out of the
    hash and the doctor's comparison (the ring keeps the mark), but an even one's numel still counts."""
    ledgers = [Ledger(), Ledger()]
    ledgers[1].mirror = RingMirror(tmp_path / "rank-1.ring", rank=1, world=2, capacity=4)
    for ledger, rows in zip(ledgers, (24, 40)):
        ledger.open(group="ep", op="all_to_all", numel=rows * 8, dtype=torch.float32, elem_size=4,
                    unit="blocks.0.mlp.experts", phase="forward", uneven=True)
    assert ledgers[0].hash == ledgers[1].hash
    dumped = [r.to_json() for r in ledgers[0].snapshot()]
    _, ringed = read_ring(tmp_path / "rank-1.ring")
    assert ringed[0]["uneven"] is True and ringed[0]["numel"] == 320
    report = analyse({0: ledger_of(0, [{**dumped[0], "kind": "collective"}]), 1: ledger_of(1, ringed)})
    assert report["verdict"] == "ok", report
    even = [Ledger(), Ledger()]
    for ledger, numel in zip(even, (64, 65)):
        ledger.open(group="shard", op="all_to_all", numel=numel, dtype=torch.float32, elem_size=4, unit="u",
                    phase="backward")
    assert even[0].hash != even[1].hash
    ledgers[1].mirror.close()


def test_dump_round_trips_with_a_header(tmp_path: Path):
    ledger = Ledger(capacity=4)
    for i in range(6):  # the ring buffer keeps the newest 4
        ledger.wait_returned(_open(ledger, unit=f"blocks.{i}"))
    path = ledger.dump(tmp_path / "ledger" / "rank-0.jsonl", rank=0, world=2, reason="hang", message="why")
    header, records = read_dump(path)
    assert header["reason"] == "hang" and header["next_seq"] == 6 and header["first_seq"] == 2
    assert [r["seq"] for r in records] == [2, 3, 4, 5] and records[0]["unit"] == "blocks.2"


def test_ring_mirror_survives_without_a_dump_and_wraps(tmp_path: Path):
    ledger = Ledger()
    ring = RingMirror(tmp_path / "rank-1.ring", rank=1, world=2, capacity=3)
    ledger.mirror = ring
    records = [_open(ledger, unit=f"blocks.{i}", numel=64 + i) for i in range(5)]
    for r in records[:4]:
        ledger.wait_returned(r)
    # No close(), no dump: what a killed process leaves.
    header, got = read_ring(tmp_path / "rank-1.ring")
    assert header["rank"] == 1 and header["next_seq"] == 5
    assert [r["seq"] for r in got] == [2, 3, 4]
    assert got[-1]["unit"] == "blocks.4" and got[-1]["numel"] == 68 and got[-1]["state"] == "scheduled"
    assert got[0]["state"] == "completed"
    ring.close()


def test_watchdog_dumps_and_aborts_on_a_blocked_collective(tmp_path: Path, monkeypatch):
    ledger = Ledger()
    ledger.wait_returned(_open(ledger, unit="blocks.0"))
    stuck = _open(ledger, unit="blocks.1")
    ledger.started(stuck)
    stuck.wait_start = time.perf_counter()
    aborted: list[str] = []
    monkeypatch.setattr(Diagnostics, "_abort", lambda self, reason: aborted.append(reason) or self._stop.set())
    with Diagnostics(ledger, run_dir=tmp_path, rank=0, world=1, hang_timeout_s=0.3, poll_s=0.05):
        deadline = time.monotonic() + 10
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.05)
    assert aborted and "hang: collective #1 all_gather" in aborted[0] and "blocks.1" in aborted[0]
    assert "zeroshard doctor" in aborted[0]
    header, records = read_dump(tmp_path / "ledger" / "rank-0.jsonl")
    assert header["reason"] == "hang" and header["in_flight"] == [1]


def test_a_raising_rank_dumps_before_the_error_propagates(tmp_path: Path):
    ledger = Ledger()
    ledger.wait_returned(_open(ledger))
    with pytest.raises(RuntimeError, match="boom"):
        with Diagnostics(ledger, run_dir=tmp_path, rank=0, world=1, hang_timeout_s=5):
            raise RuntimeError("boom")
    header, _ = read_dump(tmp_path / "ledger" / "rank-0.jsonl")
    assert header["reason"] == "error" and header["message"] == "RuntimeError: boom"
    assert "Traceback" in header["details"]


def test_process_group_timeout_is_later_than_the_watchdog():
    for hang in (3.0, 600.0):
        assert process_group_timeout(hang) > hang + 10


# --------------------------------------------------------------------------- the doctor

def rec(seq: int, unit: str = "blocks.0", op: str = "all_gather", phase: str = "forward", numel: int = 64,
        dtype: str = "float32", state: str = "completed", step: int = 1) -> dict:
    return {"kind": "collective", "seq": seq, "op": op, "numel": numel, "dtype": dtype, "group": "shard",
            "bytes": numel * 4, "unit": unit, "phase": phase, "start": 0.0, "end": None, "state": state, "step": step}


def ledger_of(rank: int, entries: list[dict], reason: str = "finished", message: str = "", world: int = 2):
    header = {"kind": "header", "rank": rank, "world": world, "reason": reason, "message": message,
              "next_seq": entries[-1]["seq"] + 1 if entries else 0,
              "in_flight": [e["seq"] for e in entries if e["state"] != "completed"]}
    return header, entries


def units(*names: str, state_last: str = "completed") -> list[dict]:
    out = [rec(i, unit=n) for i, n in enumerate(names)]
    out[-1]["state"] = state_last
    return out


def test_doctor_agrees_when_ledgers_match():
    same = units("<root>", "blocks.0", "blocks.1")
    report = analyse({0: ledger_of(0, same), 1: ledger_of(1, same)})
    assert report["verdict"] == "ok" and report["at"] is None


def test_doctor_names_the_unit_a_rank_skipped():
    r0 = units("<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3", state_last="started")
    r1 = units("<root>", "blocks.0", "blocks.1", "blocks.3")
    r1.append(rec(4, unit="blocks.3", phase="backward"))
    report = analyse({0: ledger_of(0, r0, "hang"), 1: ledger_of(1, r1, "peer")})
    assert report["verdict"] == "mismatch"
    assert report["at"] == {"seq": 3, "op": "all_gather", "unit": "blocks.2", "phase": "forward", "step": 1, "ranks": [1]}
    assert "rank 1 never entered all_gather of unit blocks.2 in phase forward" in report["summary"]


def test_doctor_calls_a_swap_a_reordering():
    r0 = units("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    r1 = units("blocks.0", "blocks.2", "blocks.1", "blocks.3")
    report = analyse({0: ledger_of(0, r0), 1: ledger_of(1, r1)})
    assert report["mismatch"]["reordered"] is not None and report["at"]["seq"] == 1
    assert "another order" in report["summary"]


def test_doctor_reports_each_differing_field_per_rank():
    r0 = [rec(0), rec(1, op="all_reduce", numel=8, state="started")]
    r1 = [rec(0), rec(1, op="all_reduce", numel=16, state="started")]
    report = analyse({0: ledger_of(0, r0, "ring"), 1: ledger_of(1, r1, "error", "RuntimeError: Connection reset")})
    assert report["mismatch"]["fields"] == ["numel"]
    assert report["at"]["seq"] == 1 and report["at"]["op"] == "all_reduce"
    assert "numel: rank 0 8, rank 1 16" in report["summary"]
    assert [d["how"] for d in report["died"]] == ["killed", "raised"]


def test_doctor_names_the_collective_a_dead_rank_never_entered():
    r0 = units("<root>", "blocks.0", "blocks.1", "blocks.2", state_last="started")
    r1 = units("<root>", "blocks.0", "blocks.1")
    report = analyse({0: ledger_of(0, r0, "peer"), 1: ledger_of(1, r1, "error", "RuntimeError: injected")})
    assert report["verdict"] == "never_entered"
    assert report["at"] == {"seq": 3, "op": "all_gather", "unit": "blocks.2", "phase": "forward", "step": 1, "ranks": [1]}
    assert "rank 1 raised: RuntimeError: injected" in report["summary"]
    text = "\n".join(render(report, "RUN"))
    assert "#3 all_gather" in text and "last entries of rank 1" in text


def test_doctor_majority_picks_the_odd_rank_out():
    good = [rec(0), rec(1, dtype="float32")]
    bad = [rec(0), rec(1, dtype="int32")]
    report = analyse({0: ledger_of(0, good, world=3), 1: ledger_of(1, bad, world=3), 2: ledger_of(2, good, world=3)})
    assert report["at"]["ranks"] == [1] and report["mismatch"]["fields"] == ["dtype"]


def test_doctor_loads_dumps_and_rings_from_a_run_dir(tmp_path: Path):
    ledger = Ledger()
    ledger.wait_returned(_open(ledger))
    ledger.dump(tmp_path / "ledger" / "rank-0.jsonl", rank=0, world=2, reason="error", message="x")
    other = Ledger()
    RingMirror(tmp_path / "ledger" / "rank-1.ring", rank=1, world=2, capacity=8)
    other.mirror = RingMirror(tmp_path / "ledger" / "rank-1.ring", rank=1, world=2, capacity=8)
    other.wait_returned(_open(other))
    _open(other, unit="blocks.1")
    ranks = load(tmp_path)
    assert ranks[0][0]["reason"] == "error" and ranks[1][0]["reason"] == "ring"
    report = analyse(ranks)
    assert report["verdict"] == "never_entered" and report["at"]["unit"] == "blocks.1"
    json.dumps(report)  # --json must serialise
    with pytest.raises(FileNotFoundError, match="no rank left a ledger"):
        load(tmp_path / "nowhere")


def test_fault_spec_is_validated():
    assert faults.parse("kind=raise,rank=1,step=2,unit=blocks.2")["unit"] == "blocks.2"
    with pytest.raises(ValueError, match="malformed"):
        faults.parse("kind=raise,rank=x")
    with pytest.raises(ValueError, match="unknown"):
        faults.parse("kind=melt,rank=1,step=1,unit=a")


def test_doctor_names_the_oldest_stuck_collective_on_a_device_async_backend():
    # NCCL: wait() returns at once, so the collectives queued behind the stuck #5 were waited on and
    # are open as well (#6), or issued and never waited on (#7); the device runs them in order.
    stuck = [rec(4), rec(5, unit="blocks.1", state="started"), rec(6, unit="blocks.2", state="started"),
             rec(7, unit="blocks.3", state="started")]
    stuck[1]["wait_start"], stuck[2]["wait_start"] = 10.0, 11.0
    header, records = ledger_of(0, stuck, "hang")
    header["stacks"] = [{"main": True, "thread": "MainThread", "stack": []}]
    for on_device in ([], [5, 6, 7]):  # a dump from before "on_device" was written, and one with it
        header["on_device"] = on_device
        blocked = analyse({0: (header, records)}, world=1)["ranks"][0]["blocked"]
        assert blocked["kind"] == "zeroshard" and blocked["entry"]["seq"] == 5
    stuck[1]["wait_start"] = None  # #5 never waited on: still the one the device is stuck in
    assert analyse({0: (header, records)}, world=1)["ranks"][0]["blocked"]["entry"]["seq"] == 5


def test_dump_names_the_collectives_still_on_the_device(tmp_path: Path):
    class Work:
        def is_completed(self) -> bool:
            return False

    ledger = Ledger()
    first, second = _open(ledger), _open(ledger, unit="blocks.1")
    ledger.started(first, Work(), device_async=True)
    ledger.started(second)
    header, _ = read_dump(ledger.dump(tmp_path / "d.jsonl", rank=0, world=1, reason="hang"))
    assert header["on_device"] == [first.seq]


def test_a_waited_device_async_collective_keeps_its_record_open_but_not_its_buffers(monkeypatch):
    import gc
    import weakref

    from zeroshard.comm import ledger as ledger_module
    from zeroshard.comm.collectives import Pending

    class Marker:  # the event behind the wait on the stream (a CPU build has no events)
        done = False

        def is_completed(self) -> bool:
            return self.done

    class Work:  # NCCL's work keeps its tensors alive until it is dropped; wait() returns at once
        def __init__(self, output: torch.Tensor) -> None:
            self.output = output

        def wait(self) -> bool:
            return True

        def is_completed(self) -> bool:
            return False

    marker = Marker()
    monkeypatch.setattr(ledger_module, "stream_marker", lambda: marker, raising=False)
    ledger, output = Ledger(), torch.zeros(1024)
    alive = weakref.ref(output)
    record = _open(ledger)
    work = Work(output)
    ledger.started(record, work, device_async=True)
    pending = Pending(work, record, ledger)
    del work, output
    pending.wait()
    gc.collect()
    assert alive() is None  # the caller's last reference is gone: so is the buffer
    assert record.state is CollectiveState.STARTED and ledger.in_flight() == [record]
    marker.done = True
    ledger.poll()
    assert record.state is CollectiveState.COMPLETED and ledger.in_flight() == []
