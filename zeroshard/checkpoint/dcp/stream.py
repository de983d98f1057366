"""Read DCP tensors a bounded batch at a time with DCP's own loader (no process group).

Each batch is a state dict of views into one of two byte buffers of the batch's size, allocated
once and used in turn, that ``dcp.load(..., no_dist=True)`` fills. Two, because the consumer may
still be hashing the last tensor of one batch while the next is read; reused, because a fresh
allocation per batch lets the C heap keep what was freed, and memory would creep up to several
batches. A tensor bigger than the batch is read alone, into its own allocation. Add the record DCP
is reading (it ``torch.load``s each saved chunk, ``weights_only=True``, before copying it in): never
the whole checkpoint.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.dcp.layout import Tensor

BATCH_BYTES = 32 * 2**20
"""Bytes read per dcp.load call: each call re-reads the small metadata file, so this need not be big."""


def _gist(error: BaseException) -> str:
    """The cause in one line: DCP wraps it in a per-rank report with tracebacks."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))
        cause = cause[0] if isinstance(cause, tuple) and cause else cause  # (exception, stack summary)
        if isinstance(cause, BaseException):
            error = cause
    first = str(error).strip().splitlines()
    return f"{type(error).__name__}: {first[0] if first else ''}"


_ALIGN = 16  # every view starts aligned for any dtype


def _padded(t: Tensor) -> int:
    return -(-t.nbytes // _ALIGN) * _ALIGN


def batches(tensors: Sequence[Tensor], budget: int) -> Iterator[list[Tensor]]:
    batch: list[Tensor] = []
    size = 0
    for t in tensors:
        if batch and size + _padded(t) > budget:
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += _padded(t)
    if batch:
        yield batch


def _targets(batch: list[Tensor], buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    if len(batch) == 1 and _padded(batch[0]) > buffer.numel():
        return {batch[0].key: torch.empty(batch[0].shape, dtype=batch[0].dtype)}
    out, offset = {}, 0
    for t in batch:
        out[t.key] = buffer[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        offset += _padded(t)
    return out


def read(path: str | os.PathLike, tensors: Sequence[Tensor], *,
         budget: int = BATCH_BYTES) -> Iterator[tuple[Tensor, torch.Tensor]]:
    """Yield (tensor, value) in the order given, loading ``budget`` bytes per dcp.load call."""
    size = min(budget, sum(_padded(t) for t in tensors))
    buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
    for turn, batch in enumerate(batches(tensors, budget)):
        state = _targets(batch, buffers[turn % 2])
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                dcp.load(state, storage_reader=FileSystemReader(Path(path)), no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
            gist = _gist(e)
            raise CheckpointError(f"{path}: dcp.load could not read {batch[0].key!r}"
                                  f"{f' (and {len(batch) - 1} more)' if len(batch) > 1 else ''}: "
                                  f"{gist}; the DCP files are "
                                  "incomplete or corrupt") from None
        for t in batch:
            yield t, state.pop(t.key)
