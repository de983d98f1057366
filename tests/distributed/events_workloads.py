"""Workers for the engine-event tests: a tiny two-block model at world 2, recording what the engine reports."""

from __future__ import annotations

import torch
from torch import nn

import zeroshard as zs
from zeroshard.runtime import EngineOptions, EventKind, get_engine

STEPS = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)  # 256 + 16 elements: the bias makes the flat buffer padded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        # 128 elements, the root unit's only param: both ranks' shards hold part of it, so both
        # ranks' optimizers read its grad shard (a shard of padding only is not read in the step).
        self.head = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _record(options: EngineOptions, mp: zs.MixedPrecision | None = None) -> dict:
    torch.manual_seed(0)
    model = zs.shard(TwoBlocks(), stage=3, mp=mp, options=options)
    engine = get_engine(model)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-2)
    rank = zs.get_mesh().rank
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    events: list[tuple[str, str, str, int]] = []
    steps = []
    with engine.events.subscribed(lambda e: events.append((e.kind.value, e.unit, e.phase, e.bytes))):
        for _ in range(STEPS):
            start = len(events)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            steps.append(events[start:])
    # After the subscription ends, nothing more is recorded; a kinds filter passes only its kinds.
    model(x).square().mean().backward()
    opt.step()
    only_steps: list[str] = []
    engine.events.subscribe(lambda e: only_steps.append(e.kind.value), kinds=[EventKind.STEP])
    model(x).square().mean().backward()
    opt.step()
    return {
        "steps": steps, "after_unsubscribe": len(events) - sum(len(s) for s in steps), "only_steps": only_steps,
        "reduce_order": [u.name for u in engine.reduce_order],
        "options": engine.options,
    }


def events_suite() -> dict:
    zs.init()
    return {
        # The deterministic schedule: a reduction is finished only at the cap or when read.
        "fp32": _record(EngineOptions(reap_when_done=False)),
        # bf16 reduction: the grads are collected into a flat buffer first (gloo cannot reduce them in place).
        "bf16": _record(EngineOptions(reap_when_done=False), zs.MixedPrecision(reduce_dtype=torch.bfloat16)),
        # Default options: reductions also finish as soon as gloo reports them done (timing-dependent).
        "default": _record(EngineOptions()),
    }
