"""Run a function on N local ranks, or join the world torchrun already made.

``spawn`` is how the CLI, the demo and the tests start gloo worlds on one machine. Its promise: if
any rank raises or dies, the others are stopped (they would otherwise wait in a collective forever)
and the caller gets a :class:`WorkerError` naming the first rank that failed and its error, within
a bounded time.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, NoReturn

_STOP_GRACE_S = 5.0


class WorkerError(RuntimeError):
    """A rank failed. ``rank`` is the first rank whose failure was observed."""

    def __init__(self, rank: int | None, reason: str, details: str = "") -> None:
        who = f"rank {rank}" if rank is not None else "the job"
        super().__init__(f"{who} failed: {reason}")
        self.rank = rank
        self.reason = reason
        self.details = details


def running_under_torchrun() -> bool:
    """True in a process that torchrun (or another launcher) started, not one of ours."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "ZEROSHARD_SPAWNED" not in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_REPORT: tuple[int, Any] | None = None
"""(rank, results queue) inside a spawned worker, so `abort_rank` can report from any thread."""


def abort_rank(reason: str, details: str = "", code: int = 1) -> NoReturn:
    """End this rank at once, from any thread, with a one-line ``reason`` for whoever launched it.

    For a thread that must stop a rank whose training thread is blocked inside a collective (the
    hang watchdog): spawned by `spawn`, the reason reaches the parent as this rank's error, like an
    exception would; under torchrun it goes to stderr and torchrun stops the peers.
    """
    if _REPORT is not None:
        rank, results = _REPORT
        try:
            results.put((rank, "error", reason, details))
            results.close()
            results.join_thread()
        except (ValueError, OSError):  # queue already closed by the training thread's own report
            pass
    else:
        rank_text = os.environ.get("RANK", "0")
        print(f"zeroshard: rank {rank_text} failed: {reason}", file=sys.stderr, flush=True)
    os._exit(code)


def prepare_exit() -> None:
    """Called as a process's work ends: make the interpreter's shutdown cheap.

    Shutdown runs full garbage collections over every object alive, and once torch and its compiler
    stack are imported that is about a second of CPU per process; the suite starts hundreds of
    rank and CLI processes. Everything alive now lives until exit anyway, so it moves to the
    permanent generation, where those collections skip it. Exit handlers, destructors of objects
    freed by reference count, and the joins of non-daemon threads run as before.
    """
    gc.freeze()


def _threads_per_rank(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def _worker(rank: int, nproc: int, port: int, fn: Callable, args: tuple, results: mp.Queue, env: dict) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZEROSHARD_SPAWNED="1",
    )
    global _REPORT
    _REPORT = (rank, results)
    import torch

    torch.set_num_threads(_threads_per_rank(nproc))
    from zeroshard.comm.mesh import shutdown

    try:
        value = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        results.put((rank, "error", reason, traceback.format_exc()))
        results.close()
        results.join_thread()  # flush the report before the hard exit below
        os._exit(1)  # skip atexit/destructors that could block on a dead collective
    # Plain pickle copies tensor bytes; torch's queue reducers would pass a shared-memory handle
    # that dies with this process before the parent can open it.
    results.put((rank, "ok", pickle.dumps(value), ""))
    shutdown()
    del value
    prepare_exit()


def spawn(fn: Callable, nproc: int, args: tuple = (), *, timeout_s: float = 600.0, env: dict | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` fresh processes that can call ``zs.init()``.

    Returns the per-rank return values in rank order. ``fn`` must be importable (module level) and
    its return value picklable. Raises :class:`WorkerError` when a rank raises, dies, or the whole
    job exceeds ``timeout_s``; the remaining ranks are terminated first.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, nproc, port, fn, args, results, dict(env or {})), daemon=False)
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    try:
        values = _collect(procs, results, timeout_s)
    except BaseException:
        _stop_all(procs)
        raise
    # Every rank reported: let them exit on their own so their exit handlers (process-group
    # teardown, offload-file cleanup) run; stop only those that do not.
    for p in procs:
        p.join(timeout=_STOP_GRACE_S)
    _stop_all(procs)
    return values


def _collect(procs: list, results: mp.Queue, timeout_s: float) -> list[Any]:
    nproc = len(procs)
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) < nproc:
        try:
            rank, status, payload, details = results.get(timeout=0.2)
        except queue.Empty:
            _raise_if_dead(procs, values, results)
            if time.monotonic() > deadline:
                missing = [r for r in range(nproc) if r not in values]
                raise WorkerError(None, f"timed out after {timeout_s:.0f}s waiting for ranks {missing}") from None
            continue
        if status == "error":
            raise WorkerError(rank, payload, details)
        values[rank] = payload
    return [pickle.loads(values[r]) for r in range(nproc)]


def _raise_if_dead(procs: list, values: dict, results: mp.Queue) -> None:
    dead = [rank for rank, p in enumerate(procs) if rank not in values and p.exitcode is not None]
    if not dead:
        return
    # A dead rank may have reported (a result or its error) just before exiting: drain first so
    # the report wins over the bare exit code.
    while True:
        try:
            rank, status, payload, details = results.get(timeout=0.5)
        except queue.Empty:
            break
        if status == "error":
            raise WorkerError(rank, payload, details)
        values[rank] = payload
    for rank in dead:
        if rank in values:
            continue
        code = procs[rank].exitcode
        how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        raise WorkerError(rank, f"process {how} before returning a result")


def _stop_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=_STOP_GRACE_S)
