"""Workers for the healing tests: the non-finite guard and the spike rollback (module level so
spawned ranks import them). One world runs every case, each on a fresh run over the same group."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

import zeroshard as zs
from zeroshard.comm import collectives
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import guard
from zeroshard.runtime.engine import get_engine
from zeroshard.trainer import step as step_mod
from zeroshard.trainer import train as train_mod
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.data import GlobalBatchSampler, build_dataset, collate

GRAD_FAULT = "ZEROSHARD_GRAD_FAULT"
BAD_STEP = 5
STEPS = 6
SEED = 7


def _cfg(mp: str, run_dir: str, **over) -> TrainConfig:
    return TrainConfig(**{**dict(model="tiny", stage=3, nproc=2, mp=mp, batch=8, seq_len=32, steps=STEPS, dropout=False,
                                 num_samples=256, warmup=2, seed=SEED, run_dir=run_dir), **over})


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in zs.full_state_dict(model).items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train_loop(cfg: TrainConfig, mesh, *, drop: int | None = None) -> dict:
    """`zeroshard train`'s step for STEPS steps; ``drop``: pass over that step's batch (never seen)."""
    run = step_mod.build(cfg, mesh)
    model_dropout_off(run.model)
    snaps, skipped, done = {}, [], 0
    for index in range(STEPS):
        if drop is not None and index + 1 == drop:
            run.sampler.next_indices()
            continue
        collectives.get_ledger().step = index + 1
        rec = train_mod.train_step(run, done)
        done += 1
        skipped.append(rec.skipped)
        snaps[index + 1] = _full(run.model)
    return {"snaps": snaps, "skipped": skipped, "report": guard.report(get_engine(run.model))}


def model_dropout_off(model) -> None:
    model.eval()  # dropout off: a run that never saw a batch must draw the same masks as one that did


def _user_loop(mp: str, mesh, *, clip: bool, drop: int | None = None) -> dict:
    """A loop of one's own: zs.shard, zs.optimizer, clip_grad_norm_ (or not), step, zero_grad."""
    data = build_dataset(seq_len=32, num_samples=256, seed=SEED)
    torch.manual_seed(SEED)
    precision = None if mp == "fp32" else zs.MixedPrecision(param_dtype=torch.bfloat16)
    model = zs.shard(GPT(GPTConfig.named("tiny", seq_len=32)), stage=3, mp=precision)
    model.eval()
    opt = zs.optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    sampler = GlobalBatchSampler(len(data), 8, world=mesh.world, rank=mesh.rank, seed=SEED)
    snaps = {}
    for index in range(STEPS):
        mine = sampler.next_indices()
        if drop is not None and index + 1 == drop:
            continue
        collectives.get_ledger().step = index + 1
        x, y = collate(data, mine)
        model(x, y).backward()
        if clip:
            zs.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        snaps[index + 1] = _full(model)
    return {"snaps": snaps, "report": guard.report(get_engine(model))}


def guard_suite(root: str) -> dict:
    """Each case with a NaN in rank 1's grad of blocks.0 at step BAD_STEP, against its reference that
    never saw that step's batch."""
    mesh = zs.init()
    out: dict = {}
    fault = f"rank=1,step={BAD_STEP},unit=blocks.0"
    for mp in ("fp32", "bf16"):
        os.environ[GRAD_FAULT] = fault
        runs = {"train": _train_loop(_cfg(mp, f"{root}/{mp}"), mesh), "user": _user_loop(mp, mesh, clip=True)}
        if mp == "fp32":
            runs["user-noclip"] = _user_loop(mp, mesh, clip=False)
        del os.environ[GRAD_FAULT]
        refs = {"train": _train_loop(_cfg(mp, f"{root}/{mp}-ref"), mesh, drop=BAD_STEP),
                "user": _user_loop(mp, mesh, clip=True, drop=BAD_STEP)}
        if mp == "fp32":
            refs["user-noclip"] = _user_loop(mp, mesh, clip=False, drop=BAD_STEP)
        for name, run in runs.items():
            snaps, ref = run["snaps"], refs[name]["snaps"]
            out[(name, mp)] = {
                "skipped": run.get("skipped"), "report": run["report"],
                "bad_step_changed_nothing": _same(snaps[BAD_STEP], snaps[BAD_STEP - 1]),
                "equal_before": _same(snaps[BAD_STEP - 1], ref[BAD_STEP - 1]),
                "equal_after": _same(snaps[STEPS], ref[STEPS]),
                "trained_after": not _same(snaps[STEPS], snaps[BAD_STEP]),
                "finite": all(bool(torch.isfinite(v).all()) for v in snaps[STEPS].values()),
            }
    out["cpu_s"] = time.process_time()
    return out


SPIKE_FAULT = "ZEROSHARD_SPIKE_FAULT"
SPIKE_STEP = 8
ROLL_STEPS = 12


def _rollback_run(mesh, root: str, name: str, **over) -> dict:
    """`zeroshard train`'s loop with checkpoints every 2 steps and rollback on (factor 5, window 3)."""
    from zeroshard.checkpoint.training import TrainingCheckpoints

    cfg = _cfg("fp32", f"{root}/{name}", steps=ROLL_STEPS, dropout=True, save_every=2,
               ckpt_dir=f"{root}/{name}-ckpt", rollback_on_spike=5.0, rollback_window=3, **over)
    with train_mod.observer_for(cfg) as obs:
        run = train_mod.setup(cfg, mesh)
        ckpts = TrainingCheckpoints(run)
        obs.attach(run.model)
        train_mod.run_loop(run, train_mod.NullReporter(), obs, 0, ckpts)
        ckpts.close()
        params = _full(run.model)
    return {"params": params, "losses": [r.loss for r in run.records], "steps": [r.step for r in run.records],
            "rollbacks": run.rollbacks, "metrics_steps": _metric_steps(f"{root}/{name}")}


def _metric_steps(run_dir: str) -> list[int]:
    path = Path(run_dir, "metrics.jsonl")
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"step"' in line]


def rollback_suite(root: str) -> dict:
    """A spike at step 8 rolls back to step 6 and skips batches 7-8; a rerun given the recorded batches
    takes the same steps without any spike."""
    mesh = zs.init()
    os.environ[SPIKE_FAULT] = f"step={SPIKE_STEP}"
    try:
        first = _rollback_run(mesh, root, "first")
    finally:
        del os.environ[SPIKE_FAULT]
    collectives.barrier()
    again = _rollback_run(mesh, root, "again", skip_from=f"{root}/first")
    return {"cpu_s": time.process_time(), "first": {k: v for k, v in first.items() if k != "params"},
            "again": {k: v for k, v in again.items() if k != "params"},
            "bitwise": _same(first["params"], again["params"])}


PP_STEPS, PP_NAN = 4, 3


def pp_loss_suite(root: str) -> dict:
    """pp=2 on world 2: the last stage's own loss reads NaN at step PP_NAN (its grads stay finite) and
    1000 times itself at the step after. Returns each step's loss and skip as this rank saw them, and
    whether each step changed this rank's masters."""
    mesh = zs.init(pp=2)
    run = step_mod.build(_cfg("fp32", f"{root}/pp", pp=2, steps=PP_STEPS, microbatches=2), mesh)
    pipe = run.pipeline
    for module in pipe.modules:
        module.eval()
    last, inner = any(m.is_last for m in pipe.modules), pipe.run

    def faulty(x, y, *, loss_scale):
        total, step = inner(x, y, loss_scale=loss_scale), collectives.get_ledger().step
        return total * {PP_NAN: float("nan"), PP_NAN + 1: 1000.0}.get(step, 1.0) if last else total

    pipe.run = faulty

    def masters() -> list[torch.Tensor]:
        return [g.shard.detach().clone() for m in pipe.modules for g in get_engine(m).trainable_groups]

    before, out = masters(), {"last": last, "losses": [], "skipped": [], "changed": []}
    for index in range(PP_STEPS):
        collectives.get_ledger().step = index + 1
        rec = train_mod.train_step(run, index)
        after = masters()
        out["losses"].append(rec.loss)
        out["skipped"].append(rec.skipped)
        out["changed"].append(not all(torch.equal(a, b) for a, b in zip(before, after)))
        before = after
    return out
