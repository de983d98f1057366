"""The training loop with replica recovery (``replica_recovery``): the healthy replica groups keep
training when one dies, and a replacement takes the live state of its shard position from a peer.

The groups meet through zeroshard/comm/replicas.py (torchft). A step here is `zeroshard train`'s
step with one more reduction: after the grads are reduced inside the group, each grad shard is
averaged over the groups taking part this step, and with it the step's [loss sum, tokens]. Each
group's grads are its own tokens' mean (zeroshard/trainer/step.py normalises by the group's token
count), so with equal token counts per group (unmasked language-model batches) the average is the
global mean over the tokens actually seen. The update is applied only when every live group
committed the step; the step count, the sampler, the LR schedule and the RNG move with the
committed steps. ``LiveState`` is what a replacement receives: this rank's fp32 master shards,
optimizer state, LR schedule, sampler, RNG and step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint import rng as rng_state
from zeroshard.comm import fault_points, get_ledger
from zeroshard.comm.collectives import all_reduce
from zeroshard.comm.replicas import Replicas
from zeroshard.observing.heal_view import REPLICAS
from zeroshard.observing.rank_metrics import METRICS_PHASE
from zeroshard.runtime.engine import get_engine
from zeroshard.trainer.data import collate
from zeroshard.trainer.step import IGNORE_INDEX, Run, accumulate_gradients, optimizer_step, skipped


class LiveState:
    """This rank's live training state, as torchft sends it to a replacement of the same shard position."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.step = 0
        self.healed = False

    def state_dict(self) -> dict[str, Any]:
        run = self.run
        engine = get_engine(run.model)
        return {"masters": [g.shard.detach().clone() for g in engine.trainable_groups],
                "optimizer": run.opt.state_dict(), "scheduler": run.scheduler.state_dict(),
                "sampler": run.sampler.state_dict(), "rng": rng_state.capture(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        run = self.run
        engine = get_engine(run.model)
        with torch.no_grad():
            for group, master in zip(engine.trainable_groups, state["masters"]):
                group.shard.copy_(master)
        run.opt.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.sampler.load_state_dict(state["sampler"])
        rng_state.restore(state["rng"])
        engine.sync_params()  # stages 1-2: the full params follow the masters just written
        self.step = int(state["step"])
        self.healed = True


def replica_step(run: Run, group: Replicas, step: int) -> dict[str, Any]:
    """One step of this group, its grads averaged over the live groups; applied only if committed."""
    cfg = run.cfg
    t0 = time.perf_counter()
    lr = run.opt.param_groups[0]["lr"]
    x, y = collate(run.dataset, run.sampler.next_indices())
    x, y = x.to(run.mesh.device), y.to(run.mesh.device)
    loss_sum, _ = accumulate_gradients(run.model, x, y, accum=cfg.accum)
    totals = torch.stack([loss_sum, (y != IGNORE_INDEX).sum().double()]).reshape(2)
    all_reduce(totals, op="sum", phase=METRICS_PHASE)  # over this group's ranks
    engine = get_engine(run.model)
    grads = [g.grad_shard for g in engine.trainable_groups if g.grad_shard is not None]
    group.average_([*grads, totals], phase="backward")
    committed = group.commit()
    norm = None
    if committed:
        norm = optimizer_step(run.model, run.opt, clip=cfg.clip, scheduler=run.scheduler)
    else:
        run.opt.zero_grad()
    dt = time.perf_counter() - t0
    # A NaN from one group's backward reaches every group through the average, so the guard skips alike.
    return {"step": step + 1, "loss": float(totals[0] / totals[1]), "lr": lr, "grad_norm": norm, "step_time_s": dt,
            "committed": committed, "participants": group.participants, "skipped": committed and skipped(run.model)}


def run_replica_loop(run: Run, reporter: Any, obs: Any, *, timeout_s: float) -> dict[str, Any]:
    """Train to ``cfg.steps`` committed steps as one of the replica groups; returns what the summary
    records (this group, its changes, a digest of its final params)."""
    live = LiveState(run)
    group = Replicas(state_dict=live.state_dict, load_state_dict=live.load_state_dict, rank=run.mesh.rank,
                     world=run.mesh.world, timeout_s=timeout_s)
    log = ChangeLog(obs.run_dir if obs is not None else None, group.replica, run.mesh.rank == 0)
    stale = logged_before(obs.run_dir) if obs is not None else 0  # a replacement's records, kept so far
    first = True
    while live.step < run.cfg.steps:
        group.start_step()  # a replacement takes the live state here
        if live.healed:
            log.record(live.step, "joined", f"took the live state of step {live.step} from a peer", group.participants)
        if obs is not None and (live.healed or (first and stale)):
            # Records up to the step this group now holds stay (a replacement's from before its group
            # died, up to the live state it took); later ones go. One that found no peer starts at 0.
            obs.rewind(live.step)
        live.healed = first = False
        get_ledger().step = live.step + 1
        fault_points.point("train.kill", rank=run.mesh.rank, step=live.step + 1)  # ZEROSHARD_KILL_FAULT, else nothing
        out = replica_step(run, group, live.step)
        log.watch(live.step + 1, group.participants)
        if not out["committed"]:
            continue  # a peer failed mid-step: the quorum re-forms and the step is taken again
        live.step += 1
        if obs is not None:
            obs.step(out["loss"], lr=out["lr"], grad_norm=out["grad_norm"], step_time_s=out["step_time_s"],
                     replicas=out["participants"], skipped=out["skipped"])
    digest = params_digest(run)
    group.shutdown()
    return {"replica": group.replica, "replica_changes": log.changes, "params_digest": digest}


class ChangeLog:
    """Replica groups leaving and joining, as this group saw them (RUN_DIR/replicas.jsonl, rank 0)."""

    def __init__(self, run_dir: Path | None, replica: int, writes: bool) -> None:
        self.path = None if run_dir is None or not writes else Path(run_dir) / REPLICAS
        self.replica = replica
        self.changes: list[dict[str, Any]] = []
        self.participants: int | None = None

    def record(self, step: int, event: str, note: str, participants: int) -> None:
        entry = {"step": step, "replica": self.replica, "event": event, "participants": participants, "note": note}
        self.changes.append(entry)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")

    def watch(self, step: int, participants: int) -> None:
        if self.participants is not None and participants != self.participants:
            event = "saw a group leave" if participants < self.participants else "saw a group join"
            self.record(step, event, f"{self.participants} -> {participants} groups training", participants)
        self.participants = participants


def logged_before(run_dir: Path) -> int:
    """The last step in RUN_DIR/metrics.jsonl when this process replaces a dead one of its group (a
    torchrun restart attempt), else 0: the observer then keeps those records instead of starting anew."""
    path = Path(run_dir) / "metrics.jsonl"
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 or not path.is_file():
        return 0
    # A line cut short by the kill is left out.
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=0)


def params_digest(run: Run) -> str:
    """A hash of this rank's master shards: equal across groups exactly when the replicas agree bitwise."""
    import hashlib

    h = hashlib.sha256()
    for group in get_engine(run.model).trainable_groups:
        h.update(group.shard.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
