"""Every thread's Python stack, for the ledger dump a rank leaves when a run hangs or fails.

The watchdog runs on its own thread while the training thread is blocked, so it can read where
the training thread is: in one of zeroshard's collectives (the ledger already says which) or
somewhere else (the user's own collective, a data loader, a lock), which only the stack shows.
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

WATCHDOG_THREAD = "zeroshard-watchdog"


def thread_stacks(limit: int = 40) -> list[dict[str, Any]]:
    """One entry per live thread, the main thread first: name, whether it is the main thread, and
    its stack as ``File ..., line ..., in ...`` lines (most recent call last). The watchdog's own
    thread is left out: its stack is this function."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    # The only way to read another thread's frames; faulthandler prints them but not as data.
    frames = sys._current_frames()  # noqa: SLF001 - documented sys function, no public equivalent
    out = []
    for ident, frame in frames.items():
        name = names.get(ident, f"thread {ident}")
        if name == WATCHDOG_THREAD:
            continue
        lines = traceback.format_list(traceback.extract_stack(frame, limit=limit))
        out.append({"thread": name, "main": ident == main, "stack": [ln.rstrip("\n") for ln in lines]})
    out.sort(key=lambda entry: not entry["main"])
    return out
