"""The step profiler: a breakdown of every step, to metrics.jsonl, and a summary at the end.

Cheap by construction: the loop's phases are timed with ``perf_counter`` (zeroshard/observing/profile/timeline.py),
collective waits are already stamped by the ledger, and the breakdown is computed from them once per
step. No collective is added per step; ``summary()`` all-gathers four floats per rank once, at the
end, for P50/P99 and the straggler. bench/profiler_overhead.py measures what it all costs.

Each step's profile covers the wall time since the previous step ended, so it includes the previous
step's checkpoint save and logging ("checkpoint", "other"): the parts add up to the real time
between steps. Every rank writes its own ``RUN_DIR/profile/rank-R.jsonl`` (with memory samples);
rank 0's profile also goes into metrics.jsonl.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal, TextIO

import torch

from zeroshard.comm import collectives
from zeroshard.comm.device_clock import WAIT_CLOCKS, DeviceClock
from zeroshard.comm.gather_rows import gather_rows
from zeroshard.observing.profile import timeline as tl
from zeroshard.observing.profile.breakdown import PHASES, breakdown, comm_stats, percentile
from zeroshard.observing.profile.flops import utilisation
from zeroshard.observing.profile.pipeline import PipelineClock, mean_of
from zeroshard.observing.profile.trace import TraceWriter

MB = 2**20


class StepProfiler:
    def __init__(self, *, rank: int, world: int, device: torch.device, batch: int, tokens_per_step: int,
                 engine: Any = None, flops: dict | None = None, peak_flops: float | None = None,
                 trace: bool = False, run_dir: str | Path | None = None, hosts: list[str] | None = None) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.hosts = hosts
        """Each rank's host (the mesh's topology), so the summary can say where the straggler runs."""
        self.batch, self.tokens_per_step = batch, tokens_per_step
        self.engine, self.flops, self.peak_flops = engine, flops, peak_flops
        self.ledger = collectives.get_ledger()
        memory, self.memory_source = tl.memory_reader(device)
        full = engine.live_full_bytes if engine is not None and hasattr(engine, "live_full_bytes") else None
        self.timeline = tl.Timeline(memory, full)
        self._subscription: Any = None
        self.trace = TraceWriter(rank) if trace else None
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.steps: list[dict[str, Any]] = []
        self._file: TextIO | None = None
        self._window_start: float | None = None
        self._last: tuple | None = None
        self._window_seq = 0
        self.pipeline: PipelineClock | None = None
        self._clock = DeviceClock(device) if device.type != "cpu" else None

    def watch_pipeline(self, pipeline: Any) -> None:
        """Under pp: time each of ``pipeline``'s stages (a ``zeroshard.parallel.pipeline.Pipeline``) from its
        engine's compute events, for the per-stage compute and bubble (zeroshard/observing/profile/pipeline.py)."""
        self.pipeline = PipelineClock(pipeline)

    @property
    def last_window(self) -> tuple | None:
        """(step, window start, spans, memory samples) of the newest profiled step; None before one."""
        return self._last

    # -- lifetime -----------------------------------------------------------------------------
    def __enter__(self) -> StepProfiler:
        if self.run_dir is not None:
            folder = self.run_dir / "profile"
            folder.mkdir(parents=True, exist_ok=True)
            self._file = (folder / f"rank-{self.rank}.jsonl").open("w")
        tl.activate(self.timeline)
        if self._clock is not None:  # NCCL's waits return at once: time them on the device
            self.ledger.clock = self._clock
        events = getattr(self.engine, "events", None)
        if events is not None:
            # Memory is sampled where the runtime gathers or frees a unit: the steps of the chart.
            from zeroshard.runtime.events import EventKind

            self._subscription = events.subscribe(self._on_event, kinds=(EventKind.GATHER, EventKind.FREE))
        return self

    def _on_event(self, event: Any) -> None:
        self.timeline.sample(f"{event.kind.value} {event.unit}")

    def __exit__(self, *exc) -> Literal[False]:
        tl.activate(None)
        if self.ledger.clock is self._clock:
            self.ledger.clock = None
        if self._subscription is not None:
            self._subscription.remove()
            self._subscription = None
        if self.pipeline is not None:
            self.pipeline.close()
        if self._file is not None:
            self._file.close()
        if self._last is not None and self.run_dir is not None:
            self._write_memory(self._last, self.run_dir / "profile" / f"memory-rank-{self.rank}.json")
        if self.trace is not None and self.run_dir is not None:
            self.trace.write(self.run_dir / "trace" / f"rank-{self.rank}.json")
        return False

    def _write_memory(self, last: tuple, path: Path) -> None:
        step, origin, spans, samples = last
        payload = {
            "step": step, "mem_source": self.memory_source,
            "samples": [[t - origin, m / MB, f / MB, label] for t, m, f, label in samples],
            "spans": [[name, a - origin, b - origin] for name, a, b in spans],
        }
        path.write_text(json.dumps(payload))

    # -- per step -----------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Before step ``step`` (0-based) starts."""
        self.ledger.step = step + 1
        if self._window_start is None:
            self._window_start, self._window_seq = time.perf_counter(), self.ledger.next_seq
            self.timeline.take()
        if self.engine is not None:
            self.engine.reset_memory_stats()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self, step: int, tokens: int | None = None) -> dict[str, Any]:
        """After step ``step`` (0-based): its profile (also kept, and written to the rank's file).
        ``tokens``: the global batch's tokens this step, when they differ from ``tokens_per_step``."""
        # On an accelerator: one sync, after which the step's waits carry device-measured times.
        clock = self._clock if self._clock is not None and self.ledger.clock is self._clock else None
        timed_on_device = clock.settle(self.ledger) if clock is not None else 0
        now = time.perf_counter()
        self.ledger.poll()
        records = self.ledger.since(self._window_seq)
        spans, samples = self.timeline.take()
        start = self._window_start
        if start is None:
            raise RuntimeError(f"StepProfiler.end({step}) without begin({step}) first")
        step_s = now - start
        parts = breakdown(spans, records, step_s)
        prof: dict[str, Any] = {"step": step + 1, "step_s": step_s, **{f"{k}_s": v for k, v in parts.items()}}
        prof.update(comm_stats(records))
        prof["wait_clock"] = "device" if timed_on_device else "host"  # what the waits measured: WAIT_CLOCKS
        prof.update(self._memory(samples))
        if self.pipeline is not None:
            prof["pipeline"] = self.pipeline.take(spans)
        prof["samples_per_s"] = self.batch / step_s
        prof["tokens"] = self.tokens_per_step if tokens is None else tokens
        prof["tokens_per_s"] = prof["tokens"] / step_s
        if self.flops is not None:
            prof["mfu"] = utilisation(self.flops["model"], prof["tokens_per_s"], self.world, self.peak_flops)
            prof["hfu"] = utilisation(self.flops["hardware"], prof["tokens_per_s"], self.world, self.peak_flops)
        self.steps.append(prof)
        # The memory chart shows one step: keep the newest step's raw samples, convert them at exit.
        self._last = (step + 1, start, spans, samples)
        if self._file is not None:
            self._file.write(json.dumps(prof) + "\n")
        if self.trace is not None:
            self.trace.add_step(step + 1, start, now, spans, records, None)
        self._window_start, self._window_seq = now, self.ledger.next_seq
        return prof

    def _memory(self, samples: list[tuple]) -> dict[str, Any]:
        out: dict[str, Any] = {"mem_source": self.memory_source}
        if self.device.type == "cuda":
            out["mem_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / MB
            out["mem_reserved_peak_mb"] = torch.cuda.max_memory_reserved(self.device) / MB
        else:
            out["mem_peak_mb"] = max((m for _, m, _, _ in samples), default=0) / MB
        if self.engine is not None:
            out["max_unsharded_units"] = self.engine.max_unsharded_units
            out["peak_full_param_mb"] = self.engine.peak_full_bytes / MB
        return out

    # -- end of run ---------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Aggregate over the steps (the first, warm-up step left out when there are others).
        Collective: every rank must call it; it all-gathers four floats per rank."""
        spans, _ = self.timeline.take()  # what ran after the last step: its checkpoint save
        checkpoint_after_last_s = sum(b - a for name, a, b in spans if name == "checkpoint")
        steps = self.steps[1:] if len(self.steps) > 1 else self.steps
        times = [s["step_s"] for s in steps] or [0.0]
        busy = sum(s["comm_busy_s"] for s in steps)
        exposed = sum(s["comm_exposed_s"] for s in steps)
        compute = sum(s["step_s"] - s["comm_exposed_s"] for s in steps) / max(1, len(steps))
        per_rank, _ = gather_rows([percentile(times, 50), percentile(times, 99), sum(times) / len(times), compute],
                                  dtype=torch.float64, group="world", phase="metrics")
        # The straggler is the rank the others wait for: the most time busy outside collective waits.
        straggler = max(range(self.world), key=lambda r: per_rank[r][3])
        n = max(1, len(steps))
        mean = {f"{k}_s": sum(s[f"{k}_s"] for s in steps) / n for k in PHASES}
        out: dict[str, Any] = {
            "profiled_steps": len(steps),
            "breakdown_mean_s": mean,
            "step_p50_s": per_rank[self.rank][0],
            "step_p99_s": per_rank[self.rank][1],
            "step_p50_s_by_rank": [row[0] for row in per_rank],
            "step_p99_s_by_rank": [row[1] for row in per_rank],
            "compute_s_by_rank": [row[3] for row in per_rank],
            "straggler_rank": straggler,
            "straggler_host": self.hosts[straggler] if self.hosts else None,
            "straggler_excess_s": per_rank[straggler][3] - min(row[3] for row in per_rank),
            "comm_bytes_per_step": sum(s["comm_bytes"] for s in steps) / n,
            "comm_busy_s_per_step": busy / n,
            "comm_exposed_s_per_step": exposed / n,
            "overlap": None if busy <= 0 else min(1.0, max(0.0, 1.0 - exposed / busy)),
            "wait_clock": (clock := "device" if any(s.get("wait_clock") == "device" for s in steps) else "host"),
            "wait_clock_means": WAIT_CLOCKS[clock],
            "ag_windows_per_step": sum(s["ag_windows"] for s in steps) / n,
            "max_unsharded_units": max((s.get("max_unsharded_units", 0) for s in self.steps), default=0),
            "mem_peak_mb": max((s["mem_peak_mb"] for s in self.steps), default=0.0),
            "mem_source": self.memory_source,
            "samples_per_s": self.batch * len(steps) / max(1e-12, sum(times)),
            "tokens_per_s": sum(s["tokens"] for s in steps) / max(1e-12, sum(times)),
            "peak_flops": self.peak_flops,
            "checkpoint_after_last_s": checkpoint_after_last_s,
        }
        if self.pipeline is not None:
            # Every pp rank's mean figures, so the summary shows each stage's share and bubble.
            by_rank = collectives.all_gather_object(mean_of(steps), group="world", phase="metrics")
            out["pipeline"] = {**self.pipeline.describe(),
                               "by_rank": [{"rank": r, **m} for r, m in enumerate(by_rank) if m is not None]}
        if self.flops is not None:
            out["flops_per_token"] = self.flops
            out["mfu"] = utilisation(self.flops["model"], out["tokens_per_s"], self.world, self.peak_flops)
            out["hfu"] = utilisation(self.flops["hardware"], out["tokens_per_s"], self.world, self.peak_flops)
        return out


def for_run(run: Any, run_dir: str | Path | None) -> StepProfiler | None:
    """The profiler for a `zeroshard.trainer.step.Run` (None when ``cfg.profile`` is off)."""
    cfg = run.cfg
    if not cfg.profile:
        return None
    return for_model(run.model, run.mesh, batch=cfg.batch, tokens_per_step=cfg.batch * cfg.seq_len,
                     peak_flops=cfg.peak_flops, trace=cfg.trace, run_dir=run_dir)


def for_model(model: Any, mesh: Any, *, batch: int = 0, tokens_per_step: int = 0, peak_flops: float | None = None,
              trace: bool = False, run_dir: str | Path | None = None) -> StepProfiler:
    """The profiler for a model on ``mesh`` (None: no per-unit memory and no MFU). MFU needs a zeroshard
    GPT (its FLOPs per token); the peak is measured with a short matmul unless ``peak_flops`` is given."""
    from zeroshard.observing.profile.flops import calibrate_peak_flops, gpt_flops
    from zeroshard.runtime import get_engine

    engine = get_engine(model) if model is not None else None
    recompute = engine is not None and engine.recompute is not None
    flops = gpt_flops(getattr(model, "cfg", None), recompute=recompute)
    peak = peak_flops
    if peak is None and flops is not None:
        compute_dtype = (engine.mp.param_dtype if engine is not None else None) or torch.float32
        peak = calibrate_peak_flops(mesh.device, compute_dtype)
    return StepProfiler(rank=mesh.rank, world=mesh.world, device=mesh.device, batch=batch,
                        tokens_per_step=tokens_per_step, engine=engine, flops=flops, peak_flops=peak,
                        trace=trace, run_dir=run_dir, hosts=_rank_hosts(mesh))


def _rank_hosts(mesh: Any) -> list[str] | None:
    placement = getattr(mesh, "placement", None)  # a stand-in mesh (tests) may have none
    return None if placement is None else [f.host for f in placement.ranks]
