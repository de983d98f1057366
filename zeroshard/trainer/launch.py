"""Run a function on N local ranks, or join the world torchrun already made.

``spawn`` is how the CLI, the demo and the tests start gloo worlds on one machine. Its promise: if
any rank raises or dies, the others are stopped (they would otherwise wait in a collective forever)
and the caller gets a :class:`WorkerError` naming the first rank that failed and its error, within
a bounded time.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable

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


# What every rank imports before it runs anything: a rank forked from a server that already holds
# them starts in a fraction of a second instead of paying torch's import (seconds of CPU) again.
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "zeroshard.comm.mesh", "zeroshard.runtime", "zeroshard.trainer.step")
"""What every rank imports anyway. torch._dynamo among them: building a model on the meta device
(zeroshard's GPT always does; HF models from a config, the planner's inventory) runs torch's meta
decompositions, whose first call imports dynamo, inductor's lowering tables and sympy, about 860
modules and 1.5-2.5 s of CPU per process."""
PRELOAD_ENV = "ZEROSHARD_SPAWN_PRELOAD"
"""Comma-separated modules to add to the preload: a program's own heavy imports (a model library),
so its ranks skip them too. Read when the first world of a process starts."""


def _preload(*modules: str) -> list[str]:
    extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    return [*_PRELOAD, *extra, *modules]


def _forks() -> bool:
    return "forkserver" in mp.get_all_start_methods()


def start_rank_server(*modules: str) -> None:
    """Start the server that local ranks fork from now, with ``modules`` (where the ranks' entry
    point lives, a model library they will import) among its preloads, so that its imports run
    while the caller is still busy with its own. A no-op under torchrun (no local ranks), where
    ranks cannot fork, or once it runs."""
    if running_under_torchrun() or not _forks():
        return
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(_preload(*modules))
    forkserver.ensure_running()


def _context(fn: Callable) -> Any:
    """The multiprocessing context ranks start from.

    ``forkserver`` where the platform has it: a server process, started once per parent (by exec,
    so nothing of the parent's state is copied), imports torch and the runtime once, and every rank
    after that is a fork of it. Only the server is forked, never the parent, so no thread or lock of
    the caller's can be caught mid-use, and CUDA is never initialised before a fork. Elsewhere,
    ``spawn``: each rank is a fresh interpreter.
    """
    if not _forks():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # The server takes the list set before its first start; later calls change nothing. A module
    # that fails to import there is skipped, and the rank imports it itself.
    ctx.set_forkserver_preload(_preload(fn.__module__))
    return ctx


def _end_like_an_interpreter() -> None:
    """What a forked rank's exit would skip: it ends in ``os._exit`` once its function returns, not
    in an interpreter's shutdown. Join the threads that shutdown would wait for (an async
    checkpoint writer finishing its files), then run the exit handlers (offload files removed,
    process-group teardown), as a spawned interpreter does at its exit."""
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and not thread.daemon:
            thread.join()
    # The standard library has no public call for this; it runs each handler once, newest first.
    atexit._run_exitfuncs()  # noqa: SLF001


def _worker(rank: int, nproc: int, port: int, fn: Callable, args: tuple, results: mp.Queue, env: dict,
            parent_env: dict | None = None) -> None:
    """One rank. ``parent_env``: the caller's environment, given to a rank forked from the server."""
    if parent_env is not None:
        # A forked rank starts with the environment its server had when it started; give it the
        # caller's current one, as a spawned interpreter would have, before the job's own entries.
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZEROSHARD_SPAWNED="1",
    )
    # Imported here, not at the top: the launcher's own process must not load torch (comm does).
    from zeroshard.comm.rank_exit import report_failures_to

    report_failures_to(rank, results)
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
    if parent_env is not None:
        _end_like_an_interpreter()


def spawn(fn: Callable, nproc: int, args: tuple = (), *, timeout_s: float = 600.0, env: dict | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` fresh processes that can call ``zs.init()``.

    Returns the per-rank return values in rank order. ``fn`` must be importable (module level) and
    its return value picklable. Raises :class:`WorkerError` when a rank raises, dies, or the whole
    job exceeds ``timeout_s``; the remaining ranks are terminated first.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    ctx = _context(fn)
    results: mp.Queue = ctx.Queue()
    port = free_port()
    parent_env = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    procs = [
        ctx.Process(target=_worker, args=(r, nproc, port, fn, args, results, dict(env or {}), parent_env),
                    daemon=False)
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
