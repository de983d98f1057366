"""Hang watchdog and failure dumps: every live rank leaves its ledger behind, and the job ends.

`Diagnostics` wraps a run on each rank (``zs.observe`` enters it, for ``zeroshard train`` and for your own loop):

- it mirrors the ledger into a crash-safe ring file (zeroshard/observing/ring.py);
- a daemon thread (`Watchdog`) polls the ledger; once the training thread has been blocked on a
  collective for longer than ``hang_timeout_s`` it tells the other ranks, dumps
  ``RUN_DIR/ledger/rank-R.jsonl``, waits briefly for the peers' dumps and ends the rank with a
  one-line reason (`zeroshard.comm.rank_exit.abort_rank`); the launcher (or torchrun) then stops the rest;
- a rank whose training code raises dumps its ledger, tells the peers, and re-raises.

The ranks talk over a side channel, a fresh client connection to the c10d TCPStore the process
group was built on, because the process group itself is the thing that is stuck. It is best effort:
if the store is gone (its host rank died) each rank still dumps its own ledger when its own timer
fires, and the ring files cover ranks that could not.

gloo has its own timeout (the process-group timeout). `process_group_timeout` sets it above the
watchdog's, so the watchdog, which names the collective and leaves dumps, always speaks first.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from zeroshard.comm.ledger import CollectiveRecord, Ledger
from zeroshard.observing.stacks import WATCHDOG_THREAD, thread_stacks

if TYPE_CHECKING:
    import torch.distributed as dist

    from zeroshard.observing.ring import RingMirror

EXIT_HANG = 3
"""Exit status of a rank stopped by the watchdog."""


def process_group_timeout(hang_timeout_s: float) -> float:
    """The process-group timeout to pair with a watchdog timeout: late enough that the watchdog
    fires, dumps and stops the job first; still finite, as a last resort."""
    return hang_timeout_s + max(15.0, 0.5 * hang_timeout_s)


def ledger_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ledger"


def describe(record: CollectiveRecord) -> str:
    unit = record.unit or "-"
    if record.phase == "user":  # recorded by zeroshard.observing: the loop's own torch.distributed call
        return (f"collective #{record.seq} {record.op}({record.numel} x {record.dtype}, group {record.group}), "
                "the training loop's own torch.distributed call")
    return (f"collective #{record.seq} {record.op}({record.numel} x {record.dtype}, group {record.group}) "
            f"of unit {unit} in phase {record.phase or '-'}")


class PeerChannel:
    """Alarm and dump flags shared by the ranks' watchdogs through the c10d store."""

    def __init__(self, rank: int, world: int, timeout_s: float = 3.0) -> None:
        self.rank, self.world = rank, world
        # A restarted torchrun attempt reuses the agent's store: keep its keys apart.
        self.prefix = f"zeroshard/diag/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.store: dist.TCPStore | None = None
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world > 1 and addr and port:
            try:
                import torch.distributed as dist

                self.store = dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=timeout_s))
            except Exception:  # noqa: BLE001 - no channel: each rank still dumps on its own
                self.store = None

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(store)``, or None once there is no store."""
        store = self.store
        if store is None:
            return None
        try:
            return fn(store)
        except Exception:  # noqa: BLE001 - the store's host may be gone; stop using it
            self.store = None
            return None

    def raise_alarm(self, message: str) -> tuple[int, str]:
        """Announce a failure; returns the alarm that stands (the first rank's, if it was earlier)."""
        key = self.prefix + "alarm"
        value = f"{self.rank}\n{message}"
        stood = self._call(lambda store: store.compare_set(key, "", value))
        return _parse_alarm(stood) if stood else (self.rank, message)

    def alarm(self) -> tuple[int, str] | None:
        key = self.prefix + "alarm"
        if not self._call(lambda store: store.check([key])):
            return None
        value = self._call(lambda store: store.get(key))
        return _parse_alarm(value) if value else None

    def mark_dumped(self) -> None:
        self._call(lambda store: store.set(self.prefix + f"dumped/{self.rank}", "1"))

    def _flagged_dumped(self, rank: int) -> bool:
        key = self.prefix + f"dumped/{rank}"
        return bool(self._call(lambda store: store.check([key])))

    def wait_for_dumps(self, timeout_s: float) -> list[int]:
        """Wait until every other rank flagged its dump (or the time is up); returns the missing ranks."""
        missing = [r for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + timeout_s
        while missing and self.store is not None and time.monotonic() < deadline:
            missing = [r for r in missing if not self._flagged_dumped(r)]
            if missing:
                time.sleep(0.05)
        return missing


def _parse_alarm(value: Any) -> tuple[int, str]:
    text = value.decode() if isinstance(value, bytes) else str(value)
    rank, _, message = text.partition("\n")
    return int(rank), message


class Diagnostics:
    """Ring mirror, watchdog and failure dumps for one rank's run (a context manager)."""

    def __init__(self, ledger: Ledger, *, run_dir: str | Path, rank: int, world: int, hang_timeout_s: float,
                 poll_s: float | None = None, ring_capacity: int = 8192,
                 header: Callable[[], dict[str, Any]] | None = None) -> None:
        if hang_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s={hang_timeout_s} must be > 0")
        self.ledger = ledger
        self.run_dir = Path(run_dir)
        self.rank, self.world = rank, world
        self.hang_timeout_s = hang_timeout_s
        self.poll_s = poll_s if poll_s is not None else min(0.5, max(0.05, hang_timeout_s / 20))
        # Time a failing rank gives its peers to dump before it goes (and the launcher kills them).
        self.grace_s = min(5.0, max(1.0, hang_timeout_s))
        self.ring_capacity = ring_capacity
        self.header = header
        """More fields for the dump's header (zeroshard.observing adds where the user's collectives came from)."""
        self.dump_path = ledger_dir(run_dir) / f"rank-{rank}.jsonl"
        self.channel: PeerChannel | None = None
        self._dumped = False
        self._dump_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mirror: RingMirror | None = None

    # -- lifetime -----------------------------------------------------------------------------
    def __enter__(self) -> Diagnostics:
        from zeroshard.observing.ring import RingMirror

        mirror = RingMirror(ledger_dir(self.run_dir) / f"rank-{self.rank}.ring", rank=self.rank, world=self.world,
                            capacity=self.ring_capacity)
        for record in self.ledger.snapshot()[-self.ring_capacity:]:
            mirror.write(record)
        self._mirror = self.ledger.mirror = mirror
        self.channel = PeerChannel(self.rank, self.world)
        self._thread = threading.Thread(target=self._watch, name=WATCHDOG_THREAD, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        if exc is not None:
            self.fail(exc)
        else:
            self.dump("finished")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.poll_s + 1.0)
        if self._mirror is not None:
            self.ledger.mirror = None
            self._mirror.close()
        return False

    # -- dumps --------------------------------------------------------------------------------
    def dump(self, reason: str, message: str = "", details: str = "") -> Path | None:
        """Write this rank's ledger once: the first failure's view is the one worth keeping."""
        with self._dump_lock:
            if self._dumped:
                return None
            self._dumped = True
            extra: dict[str, Any] = {"hang_timeout_s": self.hang_timeout_s}
            if reason != "finished":  # where every thread was: the blocked one may be outside our collectives
                extra["stacks"] = thread_stacks()
            if self.header is not None:
                extra.update(self.header())
            try:
                return self.ledger.dump(self.dump_path, rank=self.rank, world=self.world, reason=reason,
                                        message=message, details=details, extra=extra)
            except OSError as e:  # a full or read-only disk must not stop the watchdog (the ring remains)
                print(f"zeroshard: rank {self.rank} could not write {self.dump_path}: {e}", file=sys.stderr, flush=True)
                return None

    def fail(self, exc: BaseException) -> None:
        """The training thread raised: dump, alert the peers, give them a moment to dump too."""
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        blocked = [r for r in self.ledger.in_flight() if r.wait_start is not None]
        if blocked:  # a collective failed under it (a peer died): say which
            message += f" (while waiting in {describe(blocked[0])})"
        self.dump("error", message, "".join(traceback.format_exception(exc)))
        if self.channel is not None and self.world > 1:
            self.channel.raise_alarm(f"rank {self.rank} raised {message}")
            self.channel.mark_dumped()
            self.channel.wait_for_dumps(self.grace_s)

    # -- the watchdog thread ------------------------------------------------------------------
    def _watch(self) -> None:
        alarm_seen_at: float | None = None
        while not self._stop.wait(self.poll_s):
            self.ledger.poll()
            stuck = self.ledger.stuck(self.hang_timeout_s)
            alarm = self.channel.alarm() if self.channel is not None else None
            if alarm is not None and alarm[0] != self.rank:
                if alarm_seen_at is None:
                    alarm_seen_at = time.monotonic()
                    self.dump("peer", f"rank {alarm[0]} reported: {alarm[1]}")
                    if self.channel is not None:  # always: the alarm came through it
                        self.channel.mark_dumped()
                # The reporting rank's launcher stops us; if nobody does, do not linger forever.
                if time.monotonic() - alarm_seen_at > self.grace_s + 10.0:
                    self._abort(f"stopped: rank {alarm[0]} reported: {alarm[1]}")
                continue
            if stuck is not None:
                self._fire(*stuck)

    def _fire(self, record: CollectiveRecord, age: float) -> None:
        reason = (f"hang: {describe(record)} has been waiting {age:.1f}s "
                  f"(hang timeout {self.hang_timeout_s:g}s) on rank {self.rank}")
        standing = self.channel.raise_alarm(reason) if self.channel is not None else (self.rank, reason)
        if standing[0] != self.rank:
            return  # another rank spoke first; the loop dumps as a peer and waits to be stopped
        self.dump("hang", reason)
        if self.channel is not None:
            self.channel.mark_dumped()
            self.channel.wait_for_dumps(self.grace_s)
        self._abort(f"{reason}; ledgers in {ledger_dir(self.run_dir)}; run `zeroshard doctor {self.run_dir}`")

    def _abort(self, reason: str) -> None:
        from zeroshard.comm.rank_exit import abort_rank

        # The ring needs no flush: a shared file mapping outlives the process.
        abort_rank(reason, code=EXIT_HANG)
