"""Workers for per-tensor optimizers on owners (Muon + AdamW, Adafactor, a LAMB in the test).

One spawned world per world size runs every case (stage x optimizer) and returns numbers; the
single-process reference runs in the worker too (it is the same on every rank).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.optim import _muon

import zeroshard as zs
from zeroshard.runtime import get_engine
from zeroshard.runtime.optim import sharded_state

STEPS = 10
ACCUM = 2
GLOBAL_BATCH = 8
SEQ = 6
VOCAB = 37
CLIP = 0.05  # small enough to clip every step, so the global norm is really applied


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 56)
        self.fc2 = nn.Linear(56, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    """Sizes that are not multiples of the flat alignment, so params straddle shards at world 2 and 4."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's direction scaled per tensor by the trust ratio ||p|| / ||update||."""

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["m"] / (1 - beta1 ** state["step"])
                v_hat = state["v"] / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                p_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm))
                p.add_(update, alpha=-group["lr"] * float(trust))


@contextlib.contextmanager
def fp32_newton_schulz():
    """torch's Muon orthogonalises in bf16, so a grad that differs in its last fp32 bit (any
    data-parallel reduction sums in another order than one process, torch's DDP included) can move
    an update by a bf16 ulp, ~1e-4 of a param at lr 0.02. The parity cases run the same iteration
    in fp32 in both runs, so what they compare is the sharding; real bf16 figures are reported too."""
    original = _muon._zeropower_via_newtonschulz  # noqa: SLF001 (the iteration under test)

    def fp32(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.float()
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    _muon._zeropower_via_newtonschulz = fp32  # noqa: SLF001
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original  # noqa: SLF001


def matrices(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if n.startswith("blocks.") and n.endswith("weight")]


def _decay(step: int) -> float:
    return 0.9 ** step


def zs_optimizer(name: str, model: nn.Module):
    """(optimizer, scheduler or None) over a sharded model."""
    names = [n for n, _ in model.named_parameters()]
    if name == "muon_adamw":
        mats = matrices(model)
        opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, param_groups=[
            {"params": mats, "optimizer": torch.optim.Muon, "lr": 0.02},
            {"params": [n for n in names if n not in mats]}])
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, _decay)
    if name == "adafactor":
        return zs.optimizer(model, torch.optim.Adafactor, lr=1e-2, param_groups=[{"params": names}]), None
    return zs.optimizer(model, Lamb, per_tensor=True, lr=1e-2, param_groups=[{"params": names}]), None


def reference_optimizers(name: str, model: nn.Module):
    """The same optimizer on a plain model: torch's own classes, one per group."""
    if name == "muon_adamw":
        mats = set(matrices(model))
        muon = torch.optim.Muon([p for n, p in model.named_parameters() if n in mats], lr=0.02)
        adamw = torch.optim.AdamW([p for n, p in model.named_parameters() if n not in mats], lr=1e-2,
                                  weight_decay=0.1)
        return [muon, adamw], [torch.optim.lr_scheduler.LambdaLR(o, _decay) for o in (muon, adamw)]
    if name == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2)], []
    return [Lamb(model.parameters(), lr=1e-2)], []


def expected_exchange_bytes(owned, shard_rank: int) -> int:
    """From sizes and owners alone: per param, each other shard sends the owner its elements' grad and
    master (2 x 4 bytes each) and gets their new values back (4 bytes each)."""
    total = 0
    for item in owned:
        slot = item.group.layout.slots[item.slot_index]
        for holder in range(item.group.shards):
            lo, hi = item.group.layout.shard_range(holder)
            held = max(0, min(slot.offset + slot.numel, hi) - max(slot.offset, lo))
            if holder != item.owner:
                total += 8 * held * (holder == shard_rank) + 4 * held * (item.owner == shard_rank)
    return total


def batches(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    return idx, torch.roll(idx, -1, dims=1)


def reference(name: str) -> dict:
    torch.manual_seed(0)
    model = Net()
    opts, scheds = reference_optimizers(name, model)
    for step in range(STEPS):
        idx, tgt = batches(step)
        for part in range(ACCUM):
            rows = slice(part * GLOBAL_BATCH // ACCUM, (part + 1) * GLOBAL_BATCH // ACCUM)
            (model(idx[rows], tgt[rows]) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for sched in scheds:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_step(model, opt, sched, step: int, rank: int, world: int) -> None:
    """One optimizer step on this rank's rows of the global batch, in ACCUM micro-steps, clipped."""
    idx, tgt = batches(step)
    per_rank = GLOBAL_BATCH // world
    for part in range(ACCUM):
        lo = part * GLOBAL_BATCH // ACCUM + rank * per_rank // ACCUM
        rows = slice(lo, lo + per_rank // ACCUM)
        if part < ACCUM - 1:
            with zs.no_sync(model):
                (model(idx[rows], tgt[rows]) / ACCUM).backward()
        else:
            (model(idx[rows], tgt[rows]) / ACCUM).backward()
    zs.clip_grad_norm_(model, CLIP)
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()


def sharded_fp16(stage: int) -> dict:
    """LAMB on owners with fp16 compute and the sharded loss scaler: the scaler unscales and checks
    the grad shards before the owners gather them, so stages agree as in fp32."""
    mesh = zs.get_mesh()
    torch.manual_seed(0)
    model = zs.shard(Net(), stage=stage, mp=zs.MixedPrecision(param_dtype=torch.float16))
    opt, _ = zs_optimizer("lamb", model)
    scaler = zs.ShardedGradScaler(model, init_scale=2.0**10)
    per_rank = GLOBAL_BATCH // mesh.world
    for step in range(STEPS):
        idx, tgt = batches(step)
        rows = slice(mesh.rank * per_rank, (mesh.rank + 1) * per_rank)
        scaler.scale(model(idx[rows], tgt[rows])).backward()
        scaler.unscale_(opt)
        zs.clip_grad_norm_(model, CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return {"params": zs.full_state_dict(model), "skipped": scaler.skipped_steps}


def sharded(name: str, stage: int, mesh=None) -> dict:
    rank, world = (mesh or zs.get_mesh()).rank, (mesh or zs.get_mesh()).world
    torch.manual_seed(0)
    # check_schedule: every step's engine collectives are compared with its schedule (debug mode).
    model = zs.shard(Net(), stage=stage, options=zs.EngineOptions(check_schedule=True),
                     **({"mesh": mesh} if mesh is not None else {}))
    opt, sched = zs_optimizer(name, model)
    ledger = (mesh or zs.get_mesh()).ledger
    start = ledger.next_seq
    for step in range(STEPS):
        train_step(model, opt, sched, step, rank, world)
    owned = sharded_state(opt).per_tensor.owned
    shard_rank = get_engine(model).trainable_groups[0].shard_rank
    state_numel = sum(v.numel() for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0 and id(s) in
                      {id(opt.state[o.param]) for o in owned if o.mine})
    return {
        "params": zs.full_state_dict(model),
        "exchange_bytes": sum(r.bytes for r in ledger.since(start) if r.phase == "owner_exchange"),
        "expected_bytes": STEPS * expected_exchange_bytes(owned, shard_rank),
        "owned_numel": sum(o.numel for o in owned if o.mine),
        "state_numel": state_numel,
        "states_on_others": sum(1 for o in owned if not o.mine and o.param is not None),
    }


def owner_suite(directory: str) -> dict:
    """Every case on this world; at world 4 also hybrid 2 x 2 and a Muon checkpoint saved into
    ``directory``, which the world-2 suite (spawned after it) resumes."""
    mesh = zs.init()
    hybrid = mesh.world == 4
    out: dict = {}
    with fp32_newton_schulz():
        for name in ("muon_adamw", "adafactor", "lamb"):
            out[(name, "ref")] = reference(name)
            for stage in (0, 1, 2, 3):
                out[(name, stage)] = sharded(name, stage)
        if hybrid:
            mesh = zs.new_mesh(shard_size=2, name="hybrid")
            out[("muon_adamw", "hybrid3")] = sharded("muon_adamw", 3, mesh=mesh)
    # torch's own bf16 Muon: reported, and bounded by a few bf16 ulps of an update.
    out[("muon_bf16", "ref")] = reference("muon_adamw")
    for stage in (0, 3):
        out[("muon_bf16", stage)] = sharded("muon_adamw", stage)
    if mesh.world == 2:
        for stage in (0, 3):
            out[("lamb_fp16", stage)] = sharded_fp16(stage)
    out["checkpoint"] = checkpoint_save(directory) if mesh.world == 4 else checkpoint_resume(directory)
    return out


SAVED_AT = 3


def checkpoint_save(directory: str) -> dict:
    """Muon + AdamW at stage 3 (world 4): SAVED_AT steps, save, then one more step (the continuous run)."""
    mesh = zs.get_mesh()
    with fp32_newton_schulz():
        torch.manual_seed(0)
        model = zs.shard(Net(), stage=3)
        opt, sched = zs_optimizer("muon_adamw", model)
        for step in range(SAVED_AT):
            train_step(model, opt, sched, step, mesh.rank, mesh.world)
        zs.save(directory, model, opt, sched, step=SAVED_AT)
        before = zs.full_state_dict(model)
        train_step(model, opt, sched, SAVED_AT, mesh.rank, mesh.world)
        return {"before": before, "after": zs.full_state_dict(model)}


def checkpoint_resume(directory: str) -> dict:
    """The checkpoint resumed at stage 2 (world 2): the next step, with and without its optimizer state."""
    mesh = zs.get_mesh()
    out = {}
    with fp32_newton_schulz():
        for with_state in (True, False):
            torch.manual_seed(1)  # other init values: every one must come from the checkpoint
            model = zs.shard(Net(), stage=2)
            opt, sched = zs_optimizer("muon_adamw", model)
            zs.load(directory, model, opt if with_state else None, scheduler=sched if with_state else None)
            if not with_state:
                for group in opt.param_groups:  # the same lr, so only the missing state differs
                    group["lr"] = group["initial_lr"] * _decay(SAVED_AT)
            loaded = zs.full_state_dict(model)
            train_step(model, opt, sched, SAVED_AT, mesh.rank, mesh.world)
            out[with_state] = {"loaded": loaded, "after": zs.full_state_dict(model)}
    return out
