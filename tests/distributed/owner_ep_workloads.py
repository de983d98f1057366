"""Workers for per-tensor owners beside expert parallelism: tiny-moe at ep 2 x shard 2 (world 4),
the Muon recipe (Muon on the attention's matrices, AdamW on the rest, the stacked experts among
them), with torch's Muon orthogonalising in fp32 so the routing sees the same values as one process."""

from __future__ import annotations

from owner_workloads import fp32_newton_schulz
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.train import reference_train, verify_worker


def config(nproc: int, stage: int) -> TrainConfig:
    return TrainConfig(model="tiny-moe", nproc=nproc, ep=2 if nproc > 1 else 1, stage=stage, optimizer="muon",
                       steps=4, batch=8, seq_len=16, clip=1.0, num_samples=128)


def worker(stage: int) -> dict:
    with fp32_newton_schulz():
        return verify_worker(config(4, stage))


def reference() -> dict:
    with fp32_newton_schulz():
        return reference_train(config(1, 0))
