"""Disk offload's optimizer step: one slice of masters and state resident at a time.

The optimizer instance is the user's (a real ``torch.optim`` class), so each slice is stepped by
narrowing its param groups to that slice's segments and calling the class's own step. While one
slice steps, the kernel is asked to read the next one (``madvise(WILLNEED)``); after it, the slice
is written back and dropped from resident memory. Optimizer state is created lazily by torch on the
first step, in RAM, and moved into the store right after.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def chunk_segments(params: list[nn.Parameter], max_numel: int) -> list[list[nn.Parameter]]:
    chunks: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        if current and size + p.numel() > max_numel:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        chunks.append(current)
    return chunks


class SlicedStep:
    def __init__(self, optimizer, store, base_step: Callable, max_numel: int) -> None:
        self.optimizer = optimizer
        self.store = store
        self.base_step = base_step
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.chunks = chunk_segments(params, max_numel)
        self._adopted: set[int] = set()

    def _tensors(self, chunk) -> list[torch.Tensor]:
        out = []
        for p in chunk:
            out.append(p.detach())
            out.extend(t for t in self.optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor) and t.dim())
        return out

    def _adopt_state(self, chunk) -> None:
        moved_any = False
        for p in chunk:
            state = self.optimizer.state.get(p, {})
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.dim() and id(value) not in self._adopted:
                    moved = self.store.adopt(f"state-{key}", value)
                    self._adopted.add(id(moved))
                    state[key] = moved
                    moved_any = True
        if moved_any:
            self.store.return_freed_memory()

    def __call__(self, closure=None):
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        loss = None
        try:
            for index, chunk in enumerate(self.chunks):
                if index + 1 < len(self.chunks):
                    self.store.prefetch(self._tensors(self.chunks[index + 1]))
                members = {id(p) for p in chunk}
                for group, params in zip(groups, saved):
                    group["params"] = [p for p in params if id(p) in members]
                result = self.base_step(self.optimizer, closure if index == 0 else None)
                loss = result if index == 0 else loss
                self._adopt_state(chunk)
                self.store.release(self._tensors(chunk))
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
        return loss
