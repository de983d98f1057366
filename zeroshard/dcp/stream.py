"""Read DCP tensors a bounded batch at a time with DCP's own loader (no process group).

Each batch is a state dict of freshly allocated tensors that ``dcp.load(..., no_dist=True)`` fills,
so memory holds at most one batch (or one tensor, when a tensor is bigger than the batch) plus the
record DCP is reading (it ``torch.load``s each saved chunk, ``weights_only=True``, before copying it
in), never the whole checkpoint.
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
from zeroshard.dcp.layout import Tensor

BATCH_BYTES = 256 * 2**20
"""Bytes read per dcp.load call: big enough that the metadata is read rarely, small next to a model."""


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


def batches(tensors: Sequence[Tensor], budget: int) -> Iterator[list[Tensor]]:
    batch: list[Tensor] = []
    size = 0
    for t in tensors:
        if batch and size + t.nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += t.nbytes
    if batch:
        yield batch


def read(path: str | os.PathLike, tensors: Sequence[Tensor], *,
         budget: int = BATCH_BYTES) -> Iterator[tuple[Tensor, torch.Tensor]]:
    """Yield (tensor, value) in the order given, loading ``budget`` bytes per dcp.load call."""
    for batch in batches(tensors, budget):
        state = {t.key: torch.empty(t.shape, dtype=t.dtype) for t in batch}
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
