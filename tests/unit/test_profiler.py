"""The step profiler's arithmetic, trace format and FLOP counts, on synthetic timestamps."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from zeroshard.models.gpt import GPTConfig
from zeroshard.observing.profile import timeline
from zeroshard.observing.profile.breakdown import PHASES, breakdown, comm_stats, gather_windows, percentile, union_length
from zeroshard.observing.profile.flops import gpt_flops, utilisation
from zeroshard.observing.profile.trace import TraceWriter


def r(seq, op, phase, start, end, wait_start=None, waited=0.0, unit="blocks.0", observed=True, nbytes=100):
    return SimpleNamespace(seq=seq, op=op, phase=phase, start=start, end=end, wait_start=wait_start, waited=waited,
                           unit=unit, observed=observed, bytes=nbytes, numel=nbytes // 4, dtype="float32",
                           group="shard")


SPANS = [("data", 0.0, 1.0), ("forward", 1.0, 5.0), ("backward", 5.0, 10.0), ("optimizer", 10.0, 11.0)]
RECORDS = [
    r(0, "all_gather", "forward", 1.5, 3.0, wait_start=2.0, waited=1.0, unit="blocks.0"),
    r(1, "all_gather", "forward", 2.5, 4.0, unit="blocks.1"),                      # fully hidden
    r(2, "reduce_scatter", "backward", 8.0, 9.5, wait_start=8.0, waited=1.5, observed=False),
    r(3, "all_gather", "param_sync", 10.2, 10.7, wait_start=10.3, waited=0.4),
    r(4, "all_reduce", "metrics", 11.0, 11.5, wait_start=11.0, waited=0.5),
]


def test_breakdown_attributes_waits_and_sums_to_the_step():
    parts = breakdown(SPANS, RECORDS, step_s=12.0)
    assert set(parts) == set(PHASES)
    assert parts["data"] == 1.0
    assert parts["forward"] == pytest.approx(3.0) and parts["ag_wait"] == pytest.approx(1.0)
    assert parts["backward"] == pytest.approx(3.5) and parts["rs_wait"] == pytest.approx(1.5)
    assert parts["param_sync"] == pytest.approx(0.5) and parts["optimizer"] == pytest.approx(0.5)
    assert sum(parts.values()) == pytest.approx(12.0)


def test_overlap_is_one_minus_exposed_over_busy():
    stats = comm_stats(RECORDS)
    # Training collectives: [1.5, 3] u [2.5, 4] = 2.5, the reduce-scatter counts only while waited
    # (gloo runs it inside wait): 1.5, param sync 0.5. Exposed: 1 + 1.5 + 0.4. Metrics are left out.
    assert stats["comm_busy_s"] == pytest.approx(4.5)
    assert stats["comm_exposed_s"] == pytest.approx(2.9)
    assert stats["overlap"] == pytest.approx(1 - 2.9 / 4.5)
    assert stats["comm_bytes"] == 500 and stats["ag_windows"] == 2


def test_helpers():
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert gather_windows([r(0, "all_gather", "forward", 0, 1, unit="a"), r(1, "all_gather", "forward", 0, 1, unit="a"),
                           r(2, "all_gather", "backward", 0, 1, unit="a")]) == 2
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_timeline_is_a_no_op_until_activated():
    assert timeline.phase("forward") is timeline.phase("backward")  # the shared null context
    tl = timeline.Timeline(memory=lambda: 42)
    timeline.activate(tl)
    try:
        with timeline.phase("forward"):
            pass
    finally:
        timeline.activate(None)
    spans, samples = tl.take()
    assert [s[0] for s in spans] == ["forward"] and [s[3] for s in samples] == ["forward start", "forward end"]
    assert samples[0][1] == 42 and tl.take() == ([], [])


def test_trace_has_a_compute_lane_and_nesting_collective_lanes(tmp_path: Path):
    writer = TraceWriter(rank=1)
    writer.add_step(1, 0.0, 12.0, SPANS, RECORDS)
    path = writer.write(tmp_path / "rank-1.json")
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "collectives", "collectives (overlapping 2)"} <= names
    lanes: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "collective":
            lanes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():  # complete events on one lane must not overlap
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert any(e.get("cat") == "wait" and e["tid"] == 0 for e in events)
    assert all(e["pid"] == 1 for e in events)


def test_flops_count_recompute_as_hardware_only():
    cfg = GPTConfig.named("tiny", vocab_size=16, seq_len=32)
    plain, recompute = gpt_flops(cfg, recompute=False), gpt_flops(cfg, recompute=True)
    assert plain["model"] == plain["hardware"] == recompute["model"]
    block_params = 4 * (12 * 64 * 64 + 13 * 64)  # 4 blocks of qkv, proj, mlp (4x) and two norms, with biases
    assert recompute["hardware"] - recompute["model"] == 2 * block_params + 2 * 4 * 32 * 64
    assert gpt_flops(object(), recompute=False) is None
    assert utilisation(100, 10.0, world=2, peak_flops=1000.0) == pytest.approx(0.5)
    assert utilisation(None, 10.0, world=2, peak_flops=1000.0) is None


# --------------------------------------------------------------------------- waits on an accelerator


class DeviceTimeline:
    """A stream's clock for fake events: ``now`` is where the stream has got to, in seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def event(self):
        timeline = self

        class Event:
            t: float | None = None

            def record(self) -> None:
                self.t = timeline.now

            def elapsed_time(self, other) -> float:
                return (other.t - self.t) * 1e3

            def synchronize(self) -> None:
                pass

        return Event()


def test_nccl_waits_are_timed_on_the_device_not_by_the_host_stopwatch(monkeypatch):
    """NCCL's wait() returns at once; the compute stream stalls on the device instead. The ledger's
    waited is the stall between the events around the wait, and the collective's interval runs
    from its issue to the wait on the device, mapped onto the host clock."""
    import torch

    from zeroshard.comm import collectives
    from zeroshard.comm.device_clock import DeviceClock
    from zeroshard.comm.ledger import CollectiveState, Ledger

    device = DeviceTimeline()

    class Work:  # the stream waits until the collective ends, at device time 4.5; the host does not
        def wait(self) -> bool:
            device.now = 4.5
            return True

        def is_completed(self) -> bool:
            return True

    from zeroshard.comm import ledger as ledger_module

    monkeypatch.setattr(ledger_module, "stream_marker", Work)  # the event behind the wait (none on a CPU build)
    ledger = Ledger()
    ledger.clock = DeviceClock("cuda", new_event=device.event)
    monkeypatch.setattr(collectives.dist, "all_reduce", lambda *args, **kwargs: Work())
    mesh = SimpleNamespace(ledger=ledger, ledger_name="", backend="nccl", device=torch.device("cpu"), group=lambda g: None,
                           group_size=lambda g: 2)
    device.now = 1.0  # the stream reaches the issue at 1.0 ...
    pending = collectives.all_reduce(torch.zeros(8), group="shard", unit="blocks.0", phase="backward", async_op=True,
                                     mesh=mesh)
    device.now = 3.0  # ... and the wait at 3.0: compute hid 2 s of it, then stalled 1.5 s
    pending.wait()
    record = pending.record
    assert record.waited < 0.1  # the host's stopwatch: the wait returned at once
    device.now = 5.0
    assert ledger.clock.settle(ledger) == 1 and ledger.clock.settle(ledger) == 0
    assert record.waited == pytest.approx(1.5)
    assert record.end - record.start == pytest.approx(3.5) and record.observed
    assert record.state is CollectiveState.COMPLETED
    stats = comm_stats([record])
    assert stats["comm_exposed_s"] == pytest.approx(1.5) and stats["overlap"] == pytest.approx(1 - 1.5 / 3.5)


def test_the_profiler_times_waits_on_the_device_only_on_an_accelerator():
    import torch

    from zeroshard.comm import collectives
    from zeroshard.observing.profile.step import StepProfiler

    for device, clock in ((torch.device("cpu"), False), (torch.device("cuda", 0), True)):
        prof = StepProfiler(rank=0, world=1, device=device, batch=1, tokens_per_step=1)
        with prof:
            assert (collectives.get_ledger().clock is not None) is clock
        assert collectives.get_ledger().clock is None


def test_the_device_clock_forgets_collectives_closed_without_a_wait():
    from zeroshard.comm.device_clock import DeviceClock
    from zeroshard.comm.ledger import Ledger

    device, ledger = DeviceTimeline(), Ledger()
    clock = DeviceClock("cuda", new_event=device.event)
    records = [ledger.open(group="shard", op="all_gather", numel=4, dtype="float32", elem_size=4, unit=f"b{i}",
                           phase="forward") for i in range(2)]
    for record in records:
        clock.issued(record)
    ledger.complete(records[0], observed=True)  # a poll saw it done; nobody waited
    assert clock.settle(ledger) == 0 and clock.timing == [records[1].seq]  # the open one stays
