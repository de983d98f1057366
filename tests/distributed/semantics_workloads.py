"""Workers for training-semantics tests: accumulation, token normalisation, fp16 loss scaling."""

from __future__ import annotations

import contextlib
import math

import torch

import zeroshard as zs
from zeroshard.trainer.data import GlobalBatchSampler, collate
from zeroshard.runtime import get_engine

from workloads import SEED, tiny_setup
from zeroshard.models import GPT

STEPS = 3
WORLD = 2
GLOBAL_BATCH = 16


def _grad_storage_bytes(engine) -> int:
    # The last reductions of a backward may still run until the next forward starts (or a grad
    # shard is read); what stays between micro-steps is what is left once they finish.
    engine.finish_reductions()
    seen, total = set(), 0
    for group in engine.trainable_groups:
        for t in (group.grad_full, group.grad_shard):
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def _mask(y: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """Mask an uneven, rank- and step-dependent share of targets, so micro-batches and ranks
    carry different token counts."""
    y = y.clone()
    gen = torch.Generator().manual_seed(1000 * step + rank)
    keep = torch.rand(y.shape, generator=gen) < (0.3 + 0.6 * (torch.arange(y.shape[0]) % 2)).unsqueeze(1)
    y[~keep] = -100
    return y


def train(stage, accum: int, *, accumulation: str = "sharded", masked: bool = False):
    """STEPS optimizer steps; returns full params, and grad bytes seen between micro-steps.

    ``stage="ref"`` is one plain process taking the whole global batch (masked as the WORLD
    ranks would mask their slices).
    """
    mesh = zs.init()
    world, rank = (1, 0) if stage == "ref" else (mesh.world, mesh.rank)
    cfg, data = tiny_setup(GLOBAL_BATCH)
    torch.manual_seed(SEED)
    model = GPT(cfg)
    # SGD with momentum, not Adam: Adam's g / (|g| + eps) turns a 1e-7 relative rounding
    # difference in a near-zero grad into a visible update difference, which would measure
    # Adam's conditioning rather than whether accumulation is exact.
    if stage == "ref":
        opt = torch.optim.SGD(zs.optim_groups(model, 0.01), lr=0.1, momentum=0.9)
    else:
        zs.shard(model, stage=stage, accumulation=accumulation)
        opt = zs.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01)
    sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, world=world, rank=rank, seed=SEED)
    grad_bytes, norms = [], []
    for step in range(STEPS):
        x, y = collate(data, sampler.next_indices())
        if masked:
            per = GLOBAL_BATCH // WORLD
            slices = range(WORLD) if stage == "ref" else [rank]
            y = torch.cat([_mask(y[i * per:(i + 1) * per], r, step) for i, r in enumerate(slices)])
        tokens = (y != -100).sum().double().reshape(1)
        if stage != "ref":
            zs.comm.collectives.all_reduce(tokens, phase="metrics")
        scale = (1.0 if stage == "ref" else mesh.world) / tokens.item()
        micro = list(zip(x.chunk(accum), y.chunk(accum)))
        for k, (xm, ym) in enumerate(micro):
            last = k == len(micro) - 1
            ctx = contextlib.nullcontext() if last or stage == "ref" else zs.no_sync(model)
            with ctx:
                loss_sum, _ = model.loss_sum(xm, ym)
                (loss_sum * scale).backward()
            if stage != "ref" and not last:
                grad_bytes.append(_grad_storage_bytes(get_engine(model)))
        if stage == "ref":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        else:
            norms.append(float(zs.clip_grad_norm_(model, 1.0)))
        opt.step()
        opt.zero_grad()
    params = zs.full_state_dict(model) if stage != "ref" else {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {"params": params, "grad_bytes": grad_bytes, "norms": norms}
    if stage != "ref":
        engine = get_engine(model)
        out["padded_numel"] = sum(g.layout.numel for g in engine.trainable_groups)
        out["shard_numel"] = sum(g.layout.shard_numel for g in engine.trainable_groups)
    return out


def accumulation_suite() -> dict:
    out = {}
    for stage, mode in ((0, "sharded"), (1, "sharded"), (2, "sharded"), (2, "unsharded"), (3, "sharded"),
                        (3, "unsharded")):
        out[(stage, mode, 4)] = train(stage, 4, accumulation=mode)
        out[(stage, mode, 1)] = train(stage, 1, accumulation=mode)
    for stage in (0, 3):
        out[(stage, "masked", 2)] = train(stage, 2, masked=True)
    return out


def fp16_overflow_suite() -> dict:
    """fp16 compute with loss scaling; at step 3 rank 1 alone finds an inf in its own grad shard."""
    mesh = zs.init()
    out = {}
    for stage in (0, 3):
        cfg, data = tiny_setup(GLOBAL_BATCH)
        torch.manual_seed(SEED)
        model = zs.shard(GPT(cfg), stage=stage,
                         mp=zs.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32))
        engine = get_engine(model)
        opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-3)
        scaler = zs.ShardedGradScaler(model, init_scale=2.0**10, growth_interval=2)
        sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, world=mesh.world, rank=mesh.rank, seed=SEED)
        scales, stepped, losses, snapshots = [], [], [], []
        for step in range(6):
            x, y = collate(data, sampler.next_indices())
            loss = model(x, y)
            scaler.scale(loss).backward()
            if step == 2 and mesh.rank == 1:
                engine.trainable_groups[0].grad_shard[0] = math.inf  # an overflow only rank 1 can see
            before = zs.full_state_dict(model)
            scaler.unscale_(opt)
            zs.clip_grad_norm_(model, 1.0)
            stepped.append(scaler.step(opt))
            scaler.update()
            opt.zero_grad()
            after = zs.full_state_dict(model)
            snapshots.append(max((after[k] - before[k]).abs().max().item() for k in after))
            scales.append(scaler.get_scale())
            losses.append(loss.item())
        local = {f"{g.unit}:{i}": g.shard.clone() for i, g in enumerate(engine.groups)}
        out[stage] = {"scales": scales, "stepped": stepped, "losses": losses, "change_per_step": snapshots,
                      "local_shards": local, "skipped": scaler.skipped_steps,
                      "params": zs.full_state_dict(model)}
    return out


def manifest_bf16_stage3() -> dict:
    mesh = zs.init()
    cfg, data = tiny_setup(GLOBAL_BATCH)
    torch.manual_seed(SEED)
    model = zs.shard(GPT(cfg), stage=3, mp=zs.MixedPrecision(param_dtype=torch.bfloat16))
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = collate(data, GlobalBatchSampler(len(data), GLOBAL_BATCH, world=mesh.world,
                                            rank=mesh.rank, seed=SEED).next_indices())
    model(x, y).backward()
    opt.step()
    return zs.precision_manifest(model, opt)


def semantics_suite() -> dict:
    """Every case above in one process group (each builds its own model, optimizer and scaler), so
    test_semantics.py pays for one gloo world."""
    return {"accumulation": accumulation_suite(), "fp16": fp16_overflow_suite(), "manifest": manifest_bf16_stage3()}
