"""`zs.observe`: a run's instruments around any training loop, `zeroshard train`'s included.

    with zs.observe("runs/exp1", model=model, hang_timeout_s=120, log="tensorboard") as obs:
        for step in range(steps):
            loss = ...; loss.backward(); opt.step(); opt.zero_grad()
            obs.step(loss=loss, tokens=global_batch_tokens, lr=sched.get_last_lr()[0])

On every rank, while the block runs:

- the hang watchdog and the crash-safe ledger ring, with every rank's ledger and thread stacks
  dumped to RUN_DIR/ledger when a collective hangs or the code raises (zeroshard/observing/watchdog.py;
  ``zeroshard doctor RUN_DIR`` reads them);
- the torch.distributed collectives the loop itself makes are recorded too (usercalls.py);
- the step profiler (zeroshard/observing/profile/step.py): each step's breakdown, MFU, memory, comm bytes and
  exposed comm time, and P50/P99, overlap and the straggler in the summary;
- every ``desync_check`` steps, a check that all ranks issued the same collectives.

Rank 0 writes RUN_DIR/metrics.jsonl (one record per `step`, flushed as it goes), the loggers'
scalars (TensorBoard, W&B; loggers.py), and RUN_DIR/summary.json when the block ends.
``zeroshard report RUN_DIR`` draws the charts.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterable, Literal

import torch

from zeroshard.comm import collectives, host_sync
from zeroshard.observing import desync
from zeroshard.comm.mesh import get_mesh
from zeroshard.observing.watchdog import Diagnostics
from zeroshard.observing.loggers import Sink, check_installed, open_sinks, parse_log
from zeroshard.observing.usercalls import UserCollectives
from zeroshard.observing.profile.timeline import phase as tl_phase

DEFAULT_HANG_TIMEOUT_S = 300.0
"""Half of zs.init's default process-group timeout (600 s), so the watchdog speaks before gloo does."""

_ACTIVE: list[Observer] = []


def default_run_dir() -> Path:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():  # two runs started in the same second must not share a directory
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(host_sync.item(value.detach().float(), "observe.logged_value"))
    return float(value)


class Observer:
    """See the module docstring; build it with `zeroshard.observing` (``zs.observe``)."""

    def __init__(self, run_dir: str | Path | None = None, *, model: torch.nn.Module | None = None,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S, profile: bool = True, trace: bool = False,
                 log: str | Iterable[str] | None = None, desync_check: int = 0, peak_flops: float | None = None,
                 batch: int = 0, tokens_per_step: int = 0, config: dict[str, Any] | None = None,
                 record_user_collectives: bool = True) -> None:
        if hang_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s={hang_timeout_s} must be > 0")
        if desync_check < 0:
            raise ValueError(f"desync_check={desync_check} must be >= 0 (0 disables it)")
        self.log = parse_log(log)
        check_installed(self.log)  # before anything starts: a missing package is a one-line error
        self.requested_dir = run_dir
        self.model, self.hang_timeout_s, self.profile, self.trace = model, hang_timeout_s, profile, trace
        self.desync_check, self.peak_flops, self.config = desync_check, peak_flops, config
        self.batch, self.tokens_per_step = batch, tokens_per_step
        self.record_user_collectives = record_user_collectives
        self.run_dir = Path(run_dir) if run_dir is not None else Path(".")
        self.records: list[dict[str, Any]] = []
        """Every step's record on this rank (rank 0 also writes them to metrics.jsonl)."""
        self.metric_bytes = 0
        """Bytes of the observer's own collectives (desync checks), kept out of the training traffic."""
        self.profiler: Any = None
        self.user_calls: UserCollectives | None = None
        self._diagnostics: Diagnostics | None = None
        self._metrics: IO[str] | None = None
        self._sinks: list[Sink] = []
        self._next = 0
        self._attached = False
        self._summary: dict[str, Any] | None = None
        self._bytes_before = 0
        self._last_end = 0.0

    # -- lifetime -----------------------------------------------------------------------------
    def __enter__(self) -> Observer:
        if _ACTIVE:
            raise RuntimeError(f"zs.observe is already active in this process (run dir {_ACTIVE[0].run_dir}); "
                               "one observer per run: use the one you have")
        try:
            mesh = get_mesh()
        except RuntimeError as e:
            raise RuntimeError(f"zs.observe needs the process group: call zs.init() first ({e})") from None
        self.rank, self.world, self.device = mesh.rank, mesh.world, mesh.device
        self.host = mesh.placement.host_of(self.rank)
        self.rank_hosts = [f.host for f in mesh.placement.ranks]  # a killed rank's host, from any peer's dump
        # Rank 0 names the run dir (a timestamp by default); every rank dumps its ledger there.
        wanted = Path(self.requested_dir if self.requested_dir is not None else default_run_dir())
        if self.rank == 0:
            # Before the watchdog starts: starting a logger can take seconds (wandb.init), and the
            # peers, waiting in the all-gather below meanwhile, must not count that as a hang.
            self.run_dir = wanted
            wanted.mkdir(parents=True, exist_ok=True)
            self._write_config(mesh)
            self._sinks = open_sinks(self.log, self.run_dir, self.config)
        self.run_dir = Path(collectives.all_gather_object(str(wanted), phase="init")[0])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.user_calls = UserCollectives() if self.record_user_collectives else None
        self._diagnostics = Diagnostics(collectives.get_ledger(), run_dir=self.run_dir, rank=self.rank,
                                        world=self.world, hang_timeout_s=self.hang_timeout_s, header=self._header)
        self._diagnostics.__enter__()
        _ACTIVE.append(self)
        try:
            if self.user_calls is not None:
                self.user_calls.__enter__()
            if self.model is not None:
                self.attach(self.model)
        except BaseException as e:  # __exit__ will not run: stop what already started, dump, re-raise
            self._close(e)
            raise
        return self

    def _write_config(self, mesh: Any) -> None:
        """RUN_DIR/config.json for `zeroshard report` (titles) and for the record; a `zeroshard train` run
        writes its own, fuller one over it."""
        path = self.run_dir / "config.json"
        if path.exists():
            return
        payload = {"world": mesh.world, "backend": mesh.backend, "torch": torch.__version__,
                   "observe": {"hang_timeout_s": self.hang_timeout_s, "profile": self.profile, "trace": self.trace,
                               "log": list(self.log), "desync_check": self.desync_check},
                   "config": self.config}
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")

    @staticmethod
    def phase(name: str) -> Any:
        """``with obs.phase("forward"):`` marks a part of the step for the profiler's breakdown: "data",
        "forward", "backward", "optimizer" or "checkpoint" (collective waits inside forward and
        backward become all-gather and reduce wait). Unmarked time is "other"."""
        return tl_phase(name)

    def _header(self) -> dict[str, Any]:
        """Extra ledger-dump fields: where the loop's own collectives were made, and this rank's host
        (the doctor groups ranks by it)."""
        return {"user_calls": self.user_calls.header() if self.user_calls is not None else {},
                "host": self.host, "rank_hosts": self.rank_hosts}

    def attach(self, model: torch.nn.Module | None = None, *, start_step: int = 0, batch: int | None = None,
               tokens_per_step: int | None = None) -> None:
        """Start the step loop: open metrics.jsonl and the profiler. `observe(model=...)` calls it on
        entry; call it yourself when the model is built inside the block, or to resume at `start_step`
        (metrics.jsonl then keeps the records up to it). Without it the first `step` calls it."""
        from zeroshard.checkpoint.training import open_metrics
        from zeroshard.observing.profile.step import for_model

        if self._attached:
            raise RuntimeError("Observer.attach() was already called (observe(model=...) calls it on entry)")
        self._attached = True
        self.model = model if model is not None else self.model
        self.batch = self.batch if batch is None else batch
        self.tokens_per_step = self.tokens_per_step if tokens_per_step is None else tokens_per_step
        self._next = start_step
        if self.rank == 0:
            self._metrics = open_metrics(self.run_dir / "metrics.jsonl", start_step)
            if self._metrics.tell() == 0:  # a fresh file; a resumed one keeps the header it has
                self._metrics.write(json.dumps(metrics_header(get_mesh())) + "\n")
        if self.profile:
            self.profiler = for_model(self.model, get_mesh(), batch=self.batch, tokens_per_step=self.tokens_per_step,
                                      peak_flops=self.peak_flops, trace=self.trace, run_dir=self.run_dir)
            self.profiler.__enter__()
        self._bytes_before = collectives.get_ledger().total_bytes()
        self._begin()

    def _begin(self) -> None:
        collectives.get_ledger().step = self._next + 1  # stamped on every collective, for the doctor
        if self.profiler is not None:
            self.profiler.begin(self._next)
        self._last_end = time.perf_counter()

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        try:
            if exc is None and self._attached and self.records and self._summary is None:
                self.summary()  # collective: every rank leaves the block the same way
        except BaseException as e:  # noqa: BLE001 - the watchdog must still see it
            exc = e
            raise
        finally:
            self._close(exc)
        return False

    def _close(self, exc: BaseException | None) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self._metrics is not None:
            self._metrics.close()
        for sink in self._sinks:
            sink.close()
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
        if self.user_calls is not None:
            self.user_calls.__exit__(None, None, None)
        if self._diagnostics is not None:
            self._diagnostics.__exit__(type(exc) if exc else None, exc, None)

    # -- per step -----------------------------------------------------------------------------
    def step(self, loss: Any = None, *, tokens: int | None = None, lr: float | None = None,
             grad_norm: Any = None, step_time_s: float | None = None, tokens_per_s: float | None = None,
             loss_scale: float | None = None, **scalars: Any) -> dict[str, Any]:
        """After each optimizer step, on every rank. `loss` is what rank 0 logs (pass the global mean
        if you want it; a tensor is read with .item()); `tokens`: the global batch's tokens this step
        (the same on every rank; tokens/s and MFU need it); other keyword numbers are logged by name.
        Returns the step's record, as written to metrics.jsonl."""
        if not self._attached:
            self.attach()
        now = time.perf_counter()
        tokens = self.tokens_per_step if tokens is None else tokens
        prof = self.profiler.end(self._next, tokens=tokens) if self.profiler is not None else None
        dt = step_time_s if step_time_s is not None else (prof["step_s"] if prof else now - self._last_end)
        record: dict[str, Any] = {
            "step": self._next + 1, "loss": _number(loss), "lr": _number(lr), "grad_norm": _number(grad_norm),
            "step_time_s": dt, "tokens": tokens,
            "tokens_per_s": tokens_per_s if tokens_per_s is not None else (tokens / dt if dt > 0 else 0.0),
            "loss_scale": _number(loss_scale),
            **{k: _number(v) for k, v in scalars.items()},
            "profile": prof,
        }
        self.records.append(record)
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()
        if self._sinks:
            from zeroshard.observing.loggers import scalars as loggable

            values = loggable(record)
            for sink in self._sinks:
                sink.log(record["step"], values)
        if self.desync_check and record["step"] % self.desync_check == 0:
            self.metric_bytes += desync.check(record["step"])
        self._next += 1
        self._begin()
        return record

    def rewind(self, step: int) -> None:
        """Continue after step ``step`` again (a rollback reloaded its checkpoint): the records past it
        leave ``records`` and metrics.jsonl, so each step appears once, and the next one is ``step + 1``."""
        from zeroshard.checkpoint.training import open_metrics

        self.records = [r for r in self.records if r["step"] <= step]
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = open_metrics(self.run_dir / "metrics.jsonl", step)
        self._next = step
        self._begin()

    # -- end of run ---------------------------------------------------------------------------
    def summary(self, exclude_bytes: int = 0) -> dict[str, Any]:
        """Figures over the steps taken (the first, warm-up step left out of the timing when there are
        others). Collective: every rank calls it (the block's end does, unless you did). Rank 0 writes
        it to RUN_DIR/summary.json. `exclude_bytes`: the loop's own metric traffic, left out of the
        comm bytes per step."""
        from zeroshard.observing.rank_metrics import slowest_rank

        recs = self.records
        if not recs:
            raise RuntimeError("Observer.summary() before any step(): nothing to summarise")
        timed = recs[1:] if len(recs) > 1 else recs
        total_s = sum(r["step_time_s"] for r in timed)
        losses = [r["loss"] for r in recs if r["loss"] is not None]
        tail = losses[-max(1, len(losses) // 10):]  # one batch is noisy: the mean of the last tenth
        moved = collectives.get_ledger().total_bytes() - self._bytes_before - self.metric_bytes - exclude_bytes
        out: dict[str, Any] = {
            "run_dir": str(self.run_dir), "world": self.world, "steps": len(recs),
            "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
            "tail_mean_loss": sum(tail) / len(tail) if tail else None, "tail_steps": len(tail),
            "tokens_per_s": sum(r["tokens"] for r in timed) / total_s if total_s > 0 else 0.0,
            "mean_step_time_s": total_s / len(timed), "timed_steps": len(timed),
            "comm_bytes_per_step": moved / len(recs),
        }
        self.metric_bytes += 4  # the float32 all-reduce just below
        out["peak_rss_mb"] = slowest_rank(peak_rss_mb(), self.device)
        out["profile"] = self.profiler.summary() if self.profiler is not None else None
        out["topology"] = get_mesh().topology_summary()
        if self.rank == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
        self._summary = out
        return out


def metrics_header(mesh: Any) -> dict[str, Any]:
    """metrics.jsonl's first line: what the run ran on, before any step record. Readers tell it
    from a step by ``"kind": "header"`` (a step record has ``"step"`` instead)."""
    return {"kind": "header", "world": mesh.world, "backend": mesh.backend, "topology": mesh.topology_summary()}


def step_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The step records of metrics.jsonl's lines: its header left out."""
    records = (json.loads(line) for line in lines if line.strip())
    return [r for r in records if r.get("kind") != "header"]


def observe(run_dir: str | Path | None = None, **kwargs: Any) -> Observer:
    """A run's instruments around a training loop (a context manager; see `Observer`).

    Arguments (all keyword but `run_dir`): `model` (the `zs.shard` model: per-unit memory and, for a
    zeroshard GPT, MFU), `hang_timeout_s`, `profile`, `trace`, `log` ("tensorboard", "wandb", or both
    comma-separated), `desync_check` (every K steps), `peak_flops`, `batch` and `tokens_per_step`
    (defaults for `step`), `config` (a dict for W&B), `record_user_collectives`.
    """
    return Observer(run_dir, **kwargs)
