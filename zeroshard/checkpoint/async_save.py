"""Asynchronous save (``zs.save(..., async_=True)``, ``zeroshard train --save-async``).

Training stops only while each rank copies its pieces to host memory; writing, hashing and the
commit run on a background thread, with the same atomic commit, checksums and rotation as a
synchronous save (zeroshard/checkpoint/save.py):

1. every rank first finishes its previous save, if one is still in flight (at most one is), and
   carries its failure, if any, into step 2, so every rank fails together there;
2. the collective prepare of a synchronous save: rank 0 checks the target, makes
   ``.<name>.partial`` and builds the manifest skeleton;
3. each rank copies its pieces into one host buffer (pinned when the shards are on CUDA, so the
   copy runs at full link speed), reused from save to save, and captures its RNG; ``save`` returns;
4. in the background each rank writes its file from that copy into the partial directory, then
   posts its report as a small file there (``.rank-NNNNN.report.json``); rank 0 waits for every
   rank's report (no collective: the training thread owns the process group), then writes the
   manifest, commits, points ``latest`` at it and rotates.

A crash of any rank during step 4 leaves only the partial directory, so the previous checkpoint
stays the newest committed one and ``--resume auto`` picks it. The rendezvous of step 4 goes
through the checkpoint directory, which every rank already shares (rank 0 renames one directory
holding every rank's file). The host buffer is the size of the rank's pieces: masters and
elementwise optimizer state divided over the world (every element is written by one rank), which
is what the planner reports as ``checkpoint_host_bytes`` (``Plan.checkpoint_host_bytes``, in
``zeroshard plan --json``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.rankfile import RankPieces

_ALIGN = 64  # bytes: every tensor's view into the host buffer starts aligned for any dtype
_POLL_S = 0.02


class HostSnapshot:
    """One flat host buffer holding a copy of a rank's pieces, reused from save to save."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def take(self, pieces: RankPieces) -> RankPieces:
        """``pieces`` with every value copied into the buffer (grown when too small)."""
        offsets, total = [], 0
        for entry in pieces.entries:
            offsets.append(total)
            total += -(-entry.nbytes // _ALIGN) * _ALIGN
        on_cuda = any(v.device.type == "cuda" for v in pieces.values)
        if self.buffer is None or self.buffer.numel() < total or self.buffer.is_pinned() != on_cuda:
            self.buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=on_cuda)
        copies = []
        for entry, value, offset in zip(pieces.entries, pieces.values, offsets):
            copy = self.buffer[offset:offset + entry.nbytes].view(entry.dtype)
            copy.copy_(value.detach().reshape(-1), non_blocking=on_cuda)
            copies.append(copy)
        if on_cuda:
            torch.cuda.synchronize()  # the copies must be complete before training changes the shards
        return RankPieces(pieces.rank, pieces.world, pieces.entries, copies, pieces.report)

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()


SNAPSHOT = HostSnapshot()
"""This process's host buffer (one rank per process)."""


class PendingSave:
    """A save running in the background; ``wait()`` returns the committed path or raises."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.problem: str | None = None
        self.thread: threading.Thread | None = None

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def wait(self) -> Path:
        """Wait for this rank's part (on rank 0: the commit); raise its failure, if any."""
        if self.thread is not None:
            self.thread.join()
        if self.problem is not None:
            raise CheckpointError(self.problem)
        return self.path


_IN_FLIGHT: PendingSave | None = None


def in_flight() -> PendingSave | None:
    return _IN_FLIGHT


def finish_previous() -> str | None:
    """Wait for this process's save in flight, if any; its failure as a message (None: it succeeded)."""
    global _IN_FLIGHT
    pending, _IN_FLIGHT = _IN_FLIGHT, None
    if pending is None:
        return None
    try:
        pending.wait()
    except CheckpointError as e:
        return f"the previous asynchronous save {pending.path} failed on rank {pending.rank}: {e}"
    return None


def start(pending: PendingSave, work) -> PendingSave:
    """Run ``work()`` (the background half of a save) on a thread and make ``pending`` the one in
    flight. A daemon thread: a process that exits without waiting leaves an uncommitted partial
    directory, never a half-committed checkpoint."""
    global _IN_FLIGHT

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - kept for wait(), which raises it on the caller's thread
            pending.problem = pending.problem or f"{type(e).__name__}: {e}"

    pending.thread = threading.Thread(target=run, name="zs-checkpoint-save", daemon=True)
    _IN_FLIGHT = pending
    pending.thread.start()
    return pending


def report_file(partial: Path, rank: int) -> Path:
    return partial / f".rank-{rank:05d}.report.json"


def post_report(partial: Path, rank: int, report: dict | None, problem: str | None) -> None:
    """This rank's outcome, for rank 0 to collect (temp file + rename: rank 0 never reads half of it)."""
    path = report_file(partial, rank)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"report": report, "problem": problem}))
    os.replace(tmp, path)


def collect_reports(partial: Path, world: int, timeout_s: float) -> list[dict]:
    """Every rank's report, once all have posted (rank 0); removes the report files."""
    deadline = time.monotonic() + timeout_s
    paths = [report_file(partial, r) for r in range(world)]
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(paths) if not p.exists()]
            raise CheckpointError(f"ranks {missing} did not finish writing {partial} within {timeout_s:.0f} s; "
                                  "the checkpoint was not committed")
        time.sleep(_POLL_S)
    posted = [json.loads(p.read_text()) for p in paths]
    problem = next((p["problem"] for p in posted if p["problem"]), None)
    if problem:
        raise CheckpointError(problem)
    for p in paths:
        p.unlink()
    return [p["report"] for p in posted]
