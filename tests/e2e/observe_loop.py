"""A user's own training loop under `zs.observe`: stage 3, two gloo ranks, a tiny GPT.

    python observe_loop.py RUN_DIR [--steps N] [--bug-step K] [--hang-timeout-s S] [--log tensorboard]

``--bug-step K`` plants a common logging bug: at step K only rank 0 all-reduces its loss with
torch.distributed directly, so the ranks' collectives no longer pair up and the job hangs.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import zeroshard as zs
from zeroshard.trainer.launch import spawn
from zeroshard.models.gpt import GPT, GPTConfig

VOCAB, SEQ, BATCH = 64, 32, 8


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of `step` (the same global batch on every rank)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    rows = tokens.chunk(world)[rank]
    return rows[:, :-1], rows[:, 1:]


def log_loss(loss: torch.Tensor) -> None:
    """The bug: a collective that only rank 0 makes."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    print(f"step loss (sum over ranks): {total.item():.4f}", flush=True)


def loop(run_dir: str, steps: int, bug_step: int, hang_timeout_s: float, log: str) -> list[dict]:
    mesh = zs.init()
    torch.manual_seed(0)
    model = GPT(GPTConfig.named("tiny", vocab_size=VOCAB, seq_len=SEQ))
    zs.shard(model, stage=3)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=3e-3)
    with zs.observe(run_dir, model=model, hang_timeout_s=hang_timeout_s, log=log, desync_check=2) as obs:
        for step in range(1, steps + 1):
            x, y = batch(step, mesh.rank, mesh.world)
            loss = model(x, y)
            loss.backward()
            norm = zs.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            if step == bug_step and mesh.rank == 0:
                log_loss(loss)
            obs.step(loss=loss, tokens=BATCH * SEQ, lr=opt.param_groups[0]["lr"], grad_norm=norm)
        records = obs.records
    zs.shutdown()
    return records


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bug-step", type=int, default=0)
    p.add_argument("--hang-timeout-s", type=float, default=60.0)
    p.add_argument("--log", default="none")
    a = p.parse_args()
    spawn(loop, 2, args=(a.run_dir, a.steps, a.bug_step, a.hang_timeout_s, a.log))


if __name__ == "__main__":
    main()
