"""Workers for per-tensor owners inside pipeline stages: world 4 = pp 2 x shard 2, the built-in
GPT with Muon on its hidden matrices and AdamW on the rest, each stage's owners among its own
shard ranks."""

from __future__ import annotations

import zeroshard as zs
from owner_workloads import fp32_newton_schulz
from pp_workloads import _train, config


def suite() -> dict:
    mesh = zs.init(pp=2)
    with fp32_newton_schulz():
        return {stage: _train(config("gpt", stage, optimizer="muon", steps=4), mesh) for stage in (0, 3)}
