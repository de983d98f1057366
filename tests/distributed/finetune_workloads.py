"""Workers for the fine-tuning tests: held-out loss of a chat set at every stage on 2 ranks.

Module level so spawned ranks can import it; one process group runs every case."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched

from zeroshard.comm.mesh import shutdown
from zeroshard.comm.world import init
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.evaluate import evaluate
from zeroshard.trainer.step import build


def eval_config(folder: str, data: str, eval_data: str, *, stage: int, packing: str = "on") -> TrainConfig:
    return TrainConfig(model=folder, data=data, eval_data=eval_data, stage=stage, nproc=2, batch=4, seq_len=256,
                       packing=packing, dropout=False)


def eval_every_stage(folder: str, data: str, eval_data: str) -> dict[str, float]:
    """The held-out loss of the folder's model, sharded at each stage; micro-batches of 3 rows, so
    the last global batch holds filler rows. Padded rows at stage 3 as well."""
    mesh = init(backend="gloo")
    out = {}
    for stage in (0, 1, 2, 3):
        run = build(eval_config(folder, data, eval_data, stage=stage), mesh)
        out[f"stage{stage}"] = evaluate(run.model, run.eval_data, mesh, micro=3).loss
    run = build(eval_config(folder, data, eval_data, stage=3, packing="off"), mesh)
    out["stage3-padded"] = evaluate(run.model, run.eval_data, mesh, micro=2).loss
    shutdown()
    return out
