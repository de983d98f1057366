"""Workers for the fine-tuning tests: held-out loss of a chat set at every stage on 2 ranks.

Module level so spawned ranks can import it; one process group runs every case."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched

import torch

from zeroshard.comm.mesh import shutdown
from zeroshard.comm.world import init
from zeroshard.runtime import full_state_dict
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.evaluate import evaluate
from zeroshard.trainer.step import build
from zeroshard.trainer.train import train_step


def eval_config(folder: str, data: str, eval_data: str, *, stage: int, packing: str = "on") -> TrainConfig:
    return TrainConfig(model=folder, data=data, eval_data=eval_data, stage=stage, nproc=2, batch=4, seq_len=256,
                       packing=packing, dropout=False, accum=2, steps=2, warmup=0, lr=1e-2,
                       # Each rank sums its own micro-steps first, as stages 0-1 do, so the sums are
                       # the same adds in the same order (sharded accumulation adds in another order).
                       accumulation="unsharded")


def eval_every_stage(folder: str, data: str, eval_data: str) -> dict:
    """The held-out loss of the folder's model, sharded at each stage; micro-batches of 3 rows, so
    the last global batch holds filler rows. Padded rows at stage 3 as well. Then two training steps
    on packed rows at each stage: their losses and params."""
    mesh = init(backend="gloo")
    out = {}
    for stage in (0, 1, 2, 3):
        run = build(eval_config(folder, data, eval_data, stage=stage), mesh)
        out[f"stage{stage}"] = evaluate(run.model, run.eval_data, mesh, micro=3).loss
        # Two steps on packed rows (accum 2): the loss and every param, to compare bitwise across stages.
        losses = [train_step(run, step).loss for step in range(2)]
        params = full_state_dict(run.model)
        out[f"train{stage}"] = (losses, float(sum(p.double().sum() for p in params.values())),
                                torch.cat([p.flatten() for p in params.values()]))
    run = build(eval_config(folder, data, eval_data, stage=3, packing="off"), mesh)
    out["stage3-padded"] = evaluate(run.model, run.eval_data, mesh, micro=2).loss
    shutdown()
    return out
