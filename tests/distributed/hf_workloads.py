"""Workers for the Hugging Face tests: GPT-2 and Llama from small configs, every stage, and meta init.

Module level so spawned ranks can import it; each worker runs every case in one process group.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched; the configs are built in code

import torch

import zeroshard as zs
from zeroshard.trainer.data import GlobalBatchSampler, build_dataset, collate
from zeroshard.trainer.adapter import loss_sum, mean_loss
from zeroshard.models.hf import build_hf_model, init_weights
from zeroshard.runtime import get_engine
from zeroshard.runtime.wrap import find_blocks
from reference_steps import plain_adamw_steps

SEED = 1234
LR = 1e-3
WEIGHT_DECAY = 0.1
CLIP = 1.0
STEPS = 5
GLOBAL_BATCH = 8
SEQ_LEN = 32
MODELS = ("hf:gpt2-tiny", "hf:llama-tiny")


def _data():
    return build_dataset(seq_len=SEQ_LEN, num_samples=128, seed=SEED)


def _build(name: str, vocab_size: int, device: torch.device, meta: bool = False):
    return build_hf_model(name, vocab_size=vocab_size, seq_len=SEQ_LEN, seed=SEED, device=device, meta=meta)


def reference_run(name: str) -> dict:
    """Plain single-process PyTorch on the same HF model: the numerical ground truth."""
    data = _data()
    model = _build(name, data.vocab_size, torch.device("cpu"))
    losses = plain_adamw_steps(model, data, mean_loss, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED, lr=LR,
                               weight_decay=WEIGHT_DECAY, clip=CLIP)
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def sharded_run(name: str, stage: int, meta: bool = False) -> dict:
    """STEPS steps at ``stage``. The loss is normalised by the global token count, as train does."""
    mesh = zs.get_mesh()
    data = _data()
    model = _build(name, data.vocab_size, mesh.device, meta=meta)
    blocks = find_blocks(model)  # what zs.shard picks with no hints
    zs.shard(model, stage=stage, init_fn=init_weights)
    engine = get_engine(model)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
    sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, world=mesh.world, rank=mesh.rank, seed=SEED)
    losses = []
    for _ in range(STEPS):
        x, y = collate(data, sampler.next_indices())
        total, count = loss_sum(model, x, y)
        tokens = count.to(torch.float64).reshape(1)
        zs.comm.collectives.all_reduce(tokens, op="sum", phase="metrics")
        (total * (mesh.world / tokens.to(total.dtype))).backward()
        zs.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()
        both = torch.stack([total.detach().double(), count.double()])
        zs.comm.collectives.all_reduce(both, op="sum", phase="metrics")
        losses.append(float(both[0] / both[1]))
    tied = [sorted(ref.aliases) for g in engine.groups for ref in g.refs if len(ref.aliases) > 1]
    return {"losses": losses, "params": zs.full_state_dict(model), "units": [u.name for u in engine.units],
            "blocks": [n for n, _ in blocks], "block_types": sorted({type(m).__name__ for _, m in blocks}),
            "tied": tied, "init_path": engine.init_stats["path"]}


def parity_suite() -> dict:
    """Every stage for both models, then the meta-init checks, in one process group."""
    zs.init()
    out: dict = {(name, stage): sharded_run(name, stage) for name in MODELS for stage in (0, 1, 2, 3)}
    out["meta"] = meta_init_cases()
    return out


def meta_init_cases() -> dict:
    """Is a meta build, materialised shard by shard, bitwise the full build? (params and buffers)"""
    mesh = zs.get_mesh()
    out = {}
    for name in MODELS:
        vocab = _data().vocab_size
        full = _build(name, vocab, mesh.device)
        expected = full.state_dict()
        buffers = {k: b.clone() for k, b in full.named_buffers()}
        for stage in (0, 3):
            model = _build(name, vocab, mesh.device, meta=True)
            zs.shard(model, stage=stage, init_fn=init_weights)
            got = zs.full_state_dict(model)
            out[(name, stage)] = {
                "path": get_engine(model).init_stats["path"],
                "equal": got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected),
                "buffers_equal": all(torch.equal(b, buffers[k]) for k, b in model.named_buffers()),
            }
    return out
