"""Workers for the DCP tests: an FSDP2 (``fully_shard``) run saved with ``dcp.save`` moves into
zeroshard stage 3 and back, in one process group.

Module level so spawned ranks can import it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_state_dict)
from torch.distributed.fsdp import fully_shard

import zeroshard as zs
from zeroshard.comm import collectives
from zeroshard.checkpoint.dcp import export_dcp, import_dcp
from zeroshard.runtime.optim import optim_groups

SEED = 11
VOCAB, DIM = 16, 8
LR, WD = 1e-2, 0.1
FULL = StateDictOptions(full_state_dict=True)
# FSDP2 warns about every view its root module returns; the tiny model's logits are one.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


class Tiny(nn.Module):
    """Tied embedding and head, two linears (one with bias), a norm: the cases a state dict has."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 12)
        self.norm = nn.LayerNorm(12)
        self.down = nn.Linear(12, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.norm(self.up(self.embed(x))))))


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (4, 7), generator=g).chunk(world)[rank]
    return tokens[:, :-1], tokens[:, 1:]


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> None:
    x, y = _batch(step, rank, world)
    nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def _fsdp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tiny()
    fully_shard(model.up)
    fully_shard(model)
    # zs.optimizer's default groups (decay matrices, not vectors), so both runs step alike.
    return model, torch.optim.AdamW(optim_groups(model, WD), lr=LR)


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    optim = get_optimizer_state_dict(model, opt, options=FULL)["state"]
    return {"model": {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()},
            "optim": {fqn: {n: v.clone() for n, v in s.items()} for fqn, s in optim.items()}}


def _zeroshard_full(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in zs.full_state_dict(model).items()}


def suite(root: str) -> dict:
    zs.init()
    mesh = zs.get_mesh()
    rank, world, base = mesh.rank, mesh.world, Path(root)
    out: dict = {"world": world}

    # FSDP2 trains two steps and saves the way its users do.
    fsdp, opt = _fsdp(SEED)
    for step in range(2):
        _step(fsdp, opt, step, rank, world)
    msd, osd = get_state_dict(fsdp, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=base / "fsdp")
    out["fsdp"] = _full(fsdp, opt)

    # In: import (offline, rank 0), load into zeroshard stage 3 built from another seed.
    if rank == 0:
        out["imported"] = vars(import_dcp(base / "fsdp", base / "zs"))
    collectives.barrier(phase="test")
    torch.manual_seed(SEED + 1)
    model = zs.shard(Tiny(), stage=3)
    zopt = zs.optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD)
    loaded = zs.load(base / "zs", model, zopt)
    out["loaded_step"] = loaded.step
    out["zeroshard"] = _zeroshard_full(model)

    # Out: save from zeroshard, export (offline, rank 0), dcp.load into a fresh FSDP2 model.
    zs.save(base / "zs-saved", model, zopt, step=2)
    if rank == 0:
        out["exported"] = vars(export_dcp(base / "zs-saved", base / "back"))
    collectives.barrier(phase="test")
    again, opt2 = _fsdp(SEED + 2)
    msd2, osd2 = get_state_dict(again, opt2)  # initialises the optimizer state dcp.load fills in place
    dcp.load({"model": msd2, "optim": {"state": osd2["state"]}}, checkpoint_id=base / "back")
    set_state_dict(again, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    out["back"] = _full(again, opt2)

    # Both continue one step from the moved state: equal up to reduction order.
    _step(fsdp, opt, 2, rank, world)
    _step(model, zopt, 2, rank, world)
    _step(again, opt2, 2, rank, world)
    out["next"] = {"fsdp": _full(fsdp, opt)["model"], "zeroshard": _zeroshard_full(model),
                   "back": _full(again, opt2)["model"]}
    return out
