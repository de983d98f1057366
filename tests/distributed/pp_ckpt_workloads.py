"""Workers for the pipeline checkpoint tests: one world of 4 ranks visits every layout in turn.

Each run is built from a `TrainConfig` through `zeroshard.trainer.step.build` and saves and resumes through
the train loop's own `TrainingCheckpoints` (what `zeroshard train --save-every/--resume` runs), on a
mesh of its own over the same 4 ranks: (pp 2, shard 2), (pp 1, shard 4) and (pp 4, shard 1).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched; the configs are built in code

import zeroshard as zs
from zeroshard.trainer import step as step_mod
from zeroshard.checkpoint.training import TrainingCheckpoints, checkpoint_name
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.train import train_step

WORLD = 4
K = 3
"""Steps before the save; every continuous run does 2K."""
PARITY_STEPS = 10
LAYOUTS = {"pp2": dict(pp=2), "pp1": dict(pp=1), "pp4": dict(pp=4),
           "pp2i": dict(pp=2, pp_schedule="interleaved-1f1b", save_async=True), "pp2tp2": dict(pp=2, tp=2),
           # tiny-moe with its experts split over ep: GPipe over 1 microbatch keeps its load-balancing
           # loss (defined per global microbatch) the same at pp 1, so every resume can equal its run.
           "pp2ep2": dict(model="tiny-moe", pp=2, ep=2, pp_schedule="gpipe", microbatches=1),
           "pp2moe": dict(model="tiny-moe", pp=2, pp_schedule="gpipe", microbatches=1),
           "pp1ep2": dict(model="tiny-moe", pp=1, ep=2)}
"""Each layout's config over the 4 ranks: pp stages of 4/pp shard ranks each. pp2i runs two stages
per rank (interleaved 1F1B: stages 0 and 2 on pp rank 0), so a rank file holds two stages' pieces,
and saves in the background; pp2tp2 splits each stage's blocks over 2 tp ranks (shard 1)."""
RESUMES = [("pp2", 3, "pp1", 3), ("pp2", 3, "pp4", 1), ("pp1", 2, "pp2", 3), ("pp2i", 1, "pp1", 1),
           ("pp2tp2", 3, "pp1", 3), ("pp2ep2", 3, "pp2moe", 3), ("pp2ep2", 3, "pp1ep2", 3)]
"""(saved layout, saved stage, resumed layout, resumed stage)."""


def config(layout: str, stage: int, **kw: Any) -> TrainConfig:
    # warmup: the LR changes every step, so a scheduler that resumed at the wrong step changes the update
    return TrainConfig(**{"model": "tiny", "nproc": WORLD, **LAYOUTS[layout], "stage": stage, "steps": 2 * K, "warmup": 2,
                          "batch": 8, "seq_len": 32, "clip": 1.0, "num_samples": 256, "lr": 3e-3, **kw})


def full_params(run) -> dict:
    state = run.pipeline.full_state_dict() if run.pipeline is not None else zs.full_state_dict(run.model)
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def _run(cfg: TrainConfig, mesh, *, start_from: Path | None = None) -> dict:
    """Train ``cfg`` on ``mesh`` (resuming from ``start_from`` when given); the loop saves as
    `zeroshard train` does. Returns the params right after loading, after steps K and K + 1 (the
    saved ones, and the first update after them) and at the end, the losses and the resize."""
    if start_from is not None:
        cfg = dataclasses.replace(cfg, resume=str(start_from))
    run = step_mod.build(cfg, mesh)
    ckpts = TrainingCheckpoints(run, log=lambda line: None)
    start = ckpts.resume()
    out: dict[str, Any] = {"start": start, "loaded": full_params(run), "losses": []}
    for i in range(start, run.cfg.steps):
        out["losses"].append(train_step(run, i).loss)
        ckpts.after_step(i + 1)
        if i + 1 in (K, K + 1):
            out["at_save" if i + 1 == K else "after_first"] = full_params(run)
    ckpts.close()  # a background save still in flight commits (or fails) here
    out["params"] = full_params(run)
    out["lr"] = run.opt.param_groups[0]["lr"]
    out["accum"] = run.cfg.accum
    out["resize"] = None if ckpts.resize is None else ckpts.resize.as_dict()
    return out


def _parity_pp4(mesh) -> dict:
    """pp 4 (shard 1) for 10 steps, against one process in the test: 1F1B over 4 stages of one block."""
    cfg = config("pp4", 3, steps=PARITY_STEPS, warmup=0, lr=3e-4)
    run = step_mod.build(cfg, mesh)
    losses = [train_step(run, i).loss for i in range(cfg.steps)]
    pipe = run.pipeline
    return {"params": full_params(run), "losses": losses, "stages": pipe.stage_indices,
            "tied": [(t.owner_fqn, t.copy_fqn) for t in pipe.tied]}


def _llama_checkpoint(root: Path, mesh) -> dict:
    """An hf Llama (tied head) at pp 2 x shard 2, stage 3, 2 steps, saved with zs.save(pipe, opts)."""
    cfg = TrainConfig(model="hf:llama-tiny", nproc=WORLD, pp=2, stage=3, steps=2, batch=8, seq_len=32,
                      num_samples=64, lr=3e-3)
    run = step_mod.build(cfg, mesh)
    for i in range(cfg.steps):
        train_step(run, i)
    zs.save(root / "llama-pp2", run.pipeline, run.opt.items, scheduler=run.scheduler, sampler=run.sampler,
            step=cfg.steps)
    errors = {}
    for key, call in {"one stage": lambda: zs.save(root / "bad", run.model, run.opt.items[0]),
                      "optimizers": lambda: zs.load(root / "llama-pp2", run.pipeline, run.opt.items[0])}.items():
        try:
            call()
            errors[key] = "no error"
        except zs.CheckpointError as e:
            errors[key] = str(e)
    return {"params": full_params(run), "tied": [(t.owner_fqn, t.copy_fqn) for t in run.pipeline.tied],
            "errors": errors}


def suite(root: str) -> dict:
    zs.init(pp=2)
    meshes = {"pp2": zs.get_mesh(), "pp1": zs.new_mesh(name="pp1"), "pp4": zs.new_mesh(pp=4, name="pp4")}
    meshes["pp2i"] = meshes["pp2"]
    meshes["pp2tp2"] = zs.new_mesh(pp=2, tp=2, name="pp2tp2")
    meshes["pp2ep2"], meshes["pp2moe"] = zs.new_mesh(pp=2, ep=2, name="pp2ep2"), meshes["pp2"]
    meshes["pp1ep2"] = zs.new_mesh(ep=2, name="pp1ep2")
    out: dict[str, Any] = {"times": {}}

    def timed(key: Any, fn) -> None:
        t0 = time.perf_counter()
        out[key] = fn()
        out["times"][key] = time.perf_counter() - t0

    base = Path(root)
    # Each saved layout's uninterrupted run saves after step K and goes on: the run a resume must equal.
    for layout, stage in sorted({(s, st) for s, st, _, _ in RESUMES}):
        ckpt_dir = base / f"{layout}-stage{stage}"
        cfg = config(layout, stage, save_every=K, ckpt_dir=str(ckpt_dir), keep_last=0)
        timed(("continuous", layout, stage), lambda: _run(cfg, meshes[layout]))
    for saved, saved_stage, now, stage in RESUMES:
        source = base / f"{saved}-stage{saved_stage}" / checkpoint_name(K)
        timed((saved, saved_stage, now, stage), lambda: _run(config(now, stage), meshes[now], start_from=source))
    timed("pp4-parity", lambda: _parity_pp4(meshes["pp4"]))
    timed("llama", lambda: _llama_checkpoint(base, meshes["pp2"]))
    rank = zs.get_mesh().rank
    zs.shutdown()
    return out if rank == 0 else {}
