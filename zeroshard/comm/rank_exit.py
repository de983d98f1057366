"""How a rank ends itself from any thread with a reason its launcher can read.

The hang watchdog runs beside a training thread that may be blocked inside a collective forever; it
cannot raise there, so it ends the process and leaves the reason where the launcher looks: the
results queue of a rank that `zeroshard.trainer.launch.spawn` started, or stderr under torchrun.
This lives at the bottom of the package so the watchdog (observe) need not import the launcher.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

_REPORT: tuple[int, Any] | None = None
"""(rank, results queue) inside a spawned worker, so `abort_rank` can report from any thread."""


def report_failures_to(rank: int, results: Any) -> None:
    """Called by the launcher in a spawned rank: where `abort_rank` puts this rank's reason."""
    global _REPORT
    _REPORT = (rank, results)


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
