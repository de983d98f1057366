"""Workers for the runtime-rule tests: unused and frozen params, other optimizers (world 2)."""

from __future__ import annotations

import torch
from torch import nn

import zeroshard as zs
from zeroshard.runtime import get_engine

OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adagrad": (torch.optim.Adagrad, dict(lr=5e-2)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3)),
    "rmsprop_centered": (torch.optim.RMSprop, dict(lr=1e-3, centered=True, momentum=0.5)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2)),
    "radam": (torch.optim.RAdam, dict(lr=1e-2)),
    "adadelta": (torch.optim.Adadelta, dict(lr=1.0)),
    "asgd": (torch.optim.ASGD, dict(lr=5e-2, t0=2)),
    "rprop": (torch.optim.Rprop, dict(lr=1e-2)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
}


class SignMomentum(torch.optim.Optimizer):
    """A user's own elementwise optimizer (signed momentum): correct on shards once declared so."""

    def __init__(self, params, lr: float = 1e-2, beta: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["beta"]).add_(p.grad)
                p.add_(buf.sign(), alpha=-group["lr"])


class TrustRatioSGD(torch.optim.Optimizer):
    """LARS-style SGD: each tensor's step is scaled by ||p|| / ||g||, a per-tensor quantity."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                trust = p.norm() / p.grad.norm().clamp_min(1e-12)
                p.add_(p.grad, alpha=-group["lr"] * float(trust))


# Classes zs.optimizer accepts only with elementwise=True; the trust-ratio one is opted in on purpose,
# to show the wrong updates that the refusal prevents.
OPTED_IN = {
    "sign_momentum": (SignMomentum, dict(lr=1e-2)),
    "trust_ratio_opted_in": (TrustRatioSGD, dict(lr=0.1)),
}


class Branchy(nn.Module):
    """Two identical blocks and a head; ``skip_rank`` skips block 1 on that rank (an unused param)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 1)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)

    def forward(self, x, skip_block1: bool = False):
        x = torch.tanh(self.blocks[0](x))
        if not skip_block1:
            x = torch.tanh(self.blocks[1](x))
        x = x + 0.1 * self.frozen(x)
        return self.head(x).pow(2).mean()


def _data(rank: int, world: int):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 16, generator=gen)
    per = 8 // world
    return x, x[rank * per:(rank + 1) * per]


def reference_grads(world: int, skip_ranks: tuple[int, ...]) -> dict:
    """What averaged grads should be: each rank's local grad (with its own branch), averaged."""
    torch.manual_seed(0)
    model = Branchy()
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    full, _ = _data(0, world)
    per = 8 // world
    for rank in range(world):
        model.zero_grad()
        model(full[rank * per:(rank + 1) * per], skip_block1=rank in skip_ranks).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                grads[n] += p.grad / world
    return grads


def unused_and_frozen_suite() -> dict:
    mesh = zs.init()
    out = {}
    for stage in (0, 1, 2, 3):
        for skip in ("none", "rank1", "all"):
            if stage == 3 and skip == "rank1":
                # A unit that runs on one rank only is a real divergence at stage 3 (its all-gather
                # is collective); the doctor, not the runtime, has to name it.
                continue
            torch.manual_seed(0)
            model = zs.shard(Branchy(), stage=stage)
            engine = get_engine(model)
            _, x = _data(mesh.rank, mesh.world)
            skipped = skip == "all" or (skip == "rank1" and mesh.rank == 1)
            ledger = zs.ledger()
            start = ledger.next_seq
            model(x, skip_block1=skipped).backward()
            sharded_grads = {}
            for group in engine.trainable_groups:
                whole = torch.empty(group.layout.numel)
                if group.shards == 1:
                    whole = group.grad_shard.clone()
                else:
                    zs.comm.collectives.all_gather(whole, group.grad_shard, group="shard")
                for slot in group.layout.slots:
                    sharded_grads[slot.fqn] = whole[slot.offset:slot.end].view(slot.shape)
            frozen_groups = [g for g in engine.groups if not g.trainable]
            reduce_bytes = sum(r.bytes for r in ledger.since(start)
                               if r.phase == "backward" and r.op in ("reduce_scatter", "all_reduce"))
            out[(stage, skip)] = {
                "grads": sharded_grads,
                "frozen_has_grad": any(g.grad_full is not None or g.grad_shard is not None for g in frozen_groups),
                "reduce_bytes": reduce_bytes,
                "trainable_padded_bytes": sum(g.layout.numel * 4 for g in engine.trainable_groups),
            }
    return out


def optimizer_suite(steps: int = 5) -> dict:
    """Each optimizer at stages 0 and 3 on two ranks, plus the single-process reference."""
    mesh = zs.init()
    out = {}
    for name, (cls, kwargs) in {**OPTIMIZERS, **OPTED_IN}.items():
        extra = {"elementwise": True} if name in OPTED_IN else {}
        for stage in ("ref", 0, 3):
            torch.manual_seed(0)
            model = Branchy()
            if stage == "ref":
                opt = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
                x, _ = _data(0, 1)
            else:
                zs.shard(model, stage=stage)
                opt = zs.optimizer(model, cls, param_groups=[{"params": [n for n, p in model.named_parameters()
                                                                           if p.requires_grad]}], **kwargs, **extra)
                _, x = _data(mesh.rank, mesh.world)
            for _ in range(steps):
                model(x).backward()
                opt.step()
                opt.zero_grad()
            state = (zs.full_state_dict(model) if stage != "ref"
                     else {k: v.detach().clone() for k, v in model.state_dict().items()})
            out[(name, stage)] = state
    return out


def optimizer_state_roundtrip() -> dict:
    """opt.state_dict() -> fresh optimizer -> load -> the next step matches the uninterrupted one."""
    mesh = zs.init()
    results = {}
    for stage in (0, 3):
        finals = []
        for resume in (False, True):
            torch.manual_seed(0)
            model = zs.shard(Branchy(), stage=stage)
            opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
            _, x = _data(mesh.rank, mesh.world)
            for step in range(4):
                if resume and step == 2:
                    saved = opt.state_dict()
                    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
                    opt.load_state_dict(saved)
                model(x).backward()
                opt.step()
                opt.zero_grad()
            finals.append(zs.full_state_dict(model))
        results[stage] = max((finals[0][k] - finals[1][k]).abs().max().item() for k in finals[0])
    return results


def rules_suite() -> dict:
    """The three suites above in one process group (each builds its own models), so
    test_runtime_rules.py pays for one healthy gloo world; the failing one stays a spawn of its own."""
    return {"unused": unused_and_frozen_suite(), "optimizers": optimizer_suite(),
            "roundtrip": optimizer_state_roundtrip()}


def rank1_raises_before_collective() -> None:
    mesh = zs.init()
    if mesh.rank == 1:
        raise RuntimeError("injected failure on rank 1")
    zs.comm.collectives.all_reduce(torch.ones(1))  # rank 0 waits here until the launcher stops it
