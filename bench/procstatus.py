"""This process's memory as the kernel reports it in /proc/self/status (Linux), for the benches
that must count file-backed pages apart from the process's own (mmap'd safetensors, DCP files)."""

from __future__ import annotations

from pathlib import Path


def status_bytes(field: str) -> int:
    """``field`` (VmRSS, VmHWM, RssAnon, RssFile, ...) in bytes; 0 where the kernel does not report it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0
