"""Workers for per-tensor owners under tensor parallelism: world 4 = 2 shard x 2 tp, the built-in
GPT, Muon on its hidden matrices (each whole across its tp ranks on its owners) and AdamW on the
rest, against one process running torch's own Muon and AdamW on the whole model."""

from __future__ import annotations

import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from owner_workloads import fp32_newton_schulz
from tp_workloads import CLIP, GLOBAL_BATCH, LR, SEED, SEQ_LEN, STEPS, WEIGHT_DECAY, build, dataset
from zeroshard.runtime.optim import sharded_state
from zeroshard.trainer import step
from zeroshard.trainer.adapter import mean_loss
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.data import GlobalBatchSampler, collate
from zeroshard.trainer.optimizers import plain_optimizers


def reference() -> dict:
    data = dataset()
    model = build("gpt", data.vocab_size)
    opts = plain_optimizers("muon", model, lr=LR, weight_decay=WEIGHT_DECAY)
    sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, world=1, rank=0, seed=SEED)
    for _ in range(STEPS):
        x, y = collate(data, sampler.next_indices())
        mean_loss(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharded(stage: int) -> dict:
    data = dataset()
    cfg = TrainConfig(stage=stage, nproc=zs.get_mesh().world, tp=2, batch=GLOBAL_BATCH, seq_len=SEQ_LEN, lr=LR,
                      min_lr=LR, warmup=0, weight_decay=WEIGHT_DECAY, clip=CLIP, seed=SEED, optimizer="muon")
    run = step.build(cfg, zs.get_mesh(), model=build("gpt", data.vocab_size), dataset=data)
    ledger = zs.get_mesh().ledger
    start = ledger.next_seq
    for _ in range(STEPS):
        x, y = collate(run.dataset, run.sampler.next_indices())
        step.step(run, x, y)
    owned = sharded_state(run.opt).per_tensor.owned
    records = [r for r in ledger.since(start) if r.phase == "owner_exchange"]
    return {"params": zs.full_state_dict(run.model),
            "tp_split": sum(1 for o in owned if o.tp is not None),
            "tp_split_mine": sum(1 for o in owned if o.tp is not None and o.mine),
            "tp_gathers": sum(1 for r in records if r.group == "tp")}


def resumed(directory: str) -> dict:
    """Stage 3: save after STEPS - 1 steps, then the last step continuous and from the checkpoint
    (a run built from other init values, which must all come from the checkpoint)."""
    data = dataset()
    cfg = TrainConfig(stage=3, nproc=zs.get_mesh().world, tp=2, batch=GLOBAL_BATCH, seq_len=SEQ_LEN, lr=LR,
                      min_lr=LR, warmup=0, weight_decay=WEIGHT_DECAY, clip=CLIP, seed=SEED, optimizer="muon")
    sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, world=zs.get_mesh().dp_size, rank=zs.get_mesh().dp_rank,
                                 seed=SEED)
    batches = [collate(data, sampler.next_indices()) for _ in range(STEPS)]
    run = step.build(cfg, zs.get_mesh(), model=build("gpt", data.vocab_size), dataset=data)
    for x, y in batches[:-1]:
        step.step(run, x, y)
    directory = f"{directory}/ckpt"
    zs.save(directory, run.model, run.opt, step=STEPS - 1)
    step.step(run, *batches[-1])
    torch.manual_seed(99)
    model = GPT(GPTConfig.named("tiny", seq_len=SEQ_LEN, vocab_size=data.vocab_size))
    other = step.build(cfg, zs.get_mesh(), model=model, dataset=data)
    zs.load(directory, other.model, other.opt)
    step.step(other, *batches[-1])
    return {"continuous": zs.full_state_dict(run.model), "resumed": zs.full_state_dict(other.model)}


def suite(directory: str) -> dict:
    zs.init(tp=2)
    with fp32_newton_schulz():
        return {"ref": reference(), **{stage: sharded(stage) for stage in (1, 3)}, "ckpt": resumed(directory)}
