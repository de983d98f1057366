"""Workers for test_owner_plan.py: each rank's optimizer state and owner-exchange bytes under the
Muon recipe and under Adafactor, read from a real sharded step, for the planner to be held to."""

from __future__ import annotations

import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime.recipes import muon_groups
from zeroshard.tools.planner.measure import model_state_bytes

CONFIG = dict(vocab_size=128, seq_len=16)
STAGE = 3


def _optimizer(name: str, model):
    if name == "muon":
        return zs.optimizer(model, torch.optim.AdamW, lr=1e-3, param_groups=muon_groups(model, muon={"lr": 1e-3}))
    return zs.optimizer(model, torch.optim.Adafactor, lr=1e-3)


def per_rank(name: str, preset: str = "tiny") -> dict:
    """One step of a GPT preset at stage 3: this rank's optimizer bytes and exchange bytes."""
    mesh = zs.get_mesh()
    torch.manual_seed(0)
    model = zs.shard(GPT(GPTConfig.named(preset, **CONFIG)), stage=STAGE)
    opt = _optimizer(name, model)
    gen = torch.Generator().manual_seed(mesh.rank)
    idx = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["seq_len"]), generator=gen)
    start = mesh.ledger.next_seq
    loss, count = model.loss_sum(idx, idx)
    (loss / count).backward()
    opt.step()
    exchange = sum(r.bytes for r in mesh.ledger.since(start) if r.phase == "owner_exchange")
    states = model_state_bytes(model, opt)
    opt.zero_grad()
    return {"optimizer": states["optimizer"], "exchange": exchange}


def suite(preset: str = "tiny") -> dict:
    zs.init()
    return {name: per_rank(name, preset) for name in ("muon", "adafactor")}
