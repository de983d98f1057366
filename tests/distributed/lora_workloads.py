"""LoRA runs (peft adapters on a frozen base) at every stage in one spawned group, for test_lora.py."""

from __future__ import annotations

import torch

from zeroshard.comm.mesh import shutdown
from zeroshard.comm.world import init
from zeroshard.runtime import full_state_dict, get_engine
from zeroshard.trainer.train import setup, train_step


def _state_numel(opt) -> int:
    return sum(t.numel() for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)


def lora_suite(cfgs: dict) -> dict:
    """Each config trained on this world: its losses, full params (rank 0) and what the engine holds
    for the frozen base (dtype, grads, optimizer state) against the adapters."""
    mesh = init()
    out = {}
    for key, cfg in cfgs.items():
        run = setup(cfg, mesh)
        losses = [train_step(run, s).loss for s in range(cfg.steps)]
        engine = get_engine(run.model)
        frozen = [g for g in engine.groups if not g.trainable]
        out[key] = {
            "losses": losses,
            "params": {k: v.detach().float().clone() for k, v in full_state_dict(run.model).items()},
            "frozen_dtypes": sorted({str(g.shard.dtype) for g in frozen}),
            "frozen_grads": sum(int(g.grad_full is not None) + int(g.grad_shard is not None) for g in frozen),
            "frozen_numel": sum(g.layout.numel for g in frozen),
            "master_dtypes": sorted({str(g.shard.dtype) for g in engine.trainable_groups}),
            "trainable_shard_numel": sum(g.shard.numel() for g in engine.trainable_groups),
            "optimizer_numel": _state_numel(run.opt),
        }
    shutdown()
    return out
