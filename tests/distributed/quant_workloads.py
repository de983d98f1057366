"""Worker for the quantized-communication tests: one gloo group checks every case."""

from __future__ import annotations

import torch

import workloads as w
import zeroshard as zs
from zeroshard.comm import collectives
from zeroshard.comm.mesh import get_mesh
from zeroshard.comm.quant import (
    ErrorFeedback,
    dequantize,
    num_blocks,
    quantize,
    quantized_reduce_scatter,
    wire_bytes,
)
from zeroshard.trainer.data import GlobalBatchSampler, collate
from zeroshard.models import GPT
from zeroshard.runtime import get_engine

BLOCK = 256


def _one_step_bytes(comm) -> dict:
    """Per (op, phase) wire bytes of the second step (the first records the order), plus the formula inputs."""
    mesh = zs.init()
    cfg, data = w.tiny_setup(w.GLOBAL_BATCH)
    torch.manual_seed(w.SEED)
    model = zs.shard(GPT(cfg), stage=3, comm=comm)
    engine = get_engine(model)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=w.LR)
    sampler = GlobalBatchSampler(len(data), w.GLOBAL_BATCH, world=mesh.world, rank=mesh.rank, seed=w.SEED)
    ledger = zs.ledger()
    for _ in range(2):
        x, y = collate(data, sampler.next_indices())
        start = ledger.next_seq
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    by_phase: dict[str, int] = {}
    for record in ledger.since(start):
        key = f"{record.op}:{record.phase}"
        by_phase[key] = by_phase.get(key, 0) + record.bytes
    # What one all-gather of each group puts in the output buffers, per the format.
    shards = mesh.shard_size
    gather_bytes = {id(g): (shards * wire_bytes(g.layout.shard_numel, BLOCK) if g.weight_quant else g.layout.numel * 4)
                    for g in engine.groups}
    kept = {id(g) for u in engine.kept_for_backward() for g in u.groups} | \
        {id(g) for u in engine.units if u.is_root for g in u.groups}
    return {
        "by_phase": by_phase,
        "forward_formula": sum(gather_bytes.values()),
        "backward_formula": sum(b for k, b in gather_bytes.items() if k not in kept),
        "fp32_forward": sum(g.layout.numel * 4 for g in engine.groups),
        "quantized_groups": sum(1 for g in engine.groups if g.weight_quant),
        "grad_formula": sum(shards * wire_bytes(g.layout.shard_numel, BLOCK) for g in engine.groups if g.grad_quant),
        "grad_unquantized_formula": sum(g.layout.numel * 4 for g in engine.groups
                                        if g.trainable and not g.grad_quant),
        "grad_fp32": sum(g.layout.numel * 4 for g in engine.groups if g.trainable),
        "groups": len(engine.groups),
        "manifest": zs.precision_manifest(model, opt),
        "residual_bytes": sum(g.grad_feedback.residual.numel() * g.grad_feedback.residual.element_size()
                              for g in engine.groups if g.grad_feedback is not None
                              and g.grad_feedback.residual is not None),
        "residual_formula": sum(g.layout.numel * 4 for g in engine.groups if g.grad_quant),
    }


def _gather_consistency(model) -> dict:
    """Re-gather each quantized unit as forward does; compare with the exact masters."""
    engine = get_engine(model)
    exact = zs.full_state_dict(model)  # exact path: the masters, never quantized
    worst_excess, own_exact, same_across = 0.0, True, True
    checked = 0
    for unit in engine.units:
        groups = [g for g in unit.groups if g.weight_quant]
        if not groups:
            continue
        unit.unshard("forward")
        unit.wait_unshard()
        for g in groups:
            truth = torch.zeros(g.layout.numel)
            for slot, ref in zip(g.layout.slots, g.refs):
                truth[slot.offset:slot.end] = exact[ref.fqn].reshape(-1)
            full = g.full.detach().clone()
            # The owner's masters are untouched by quantization...
            own_exact &= torch.equal(truth[g.lo:g.hi], g.shard.detach())
            # ...and the forward uses exactly dequantize(quantize(owner's master)) for every shard.
            per = g.layout.shard_numel
            for r in range(g.shards):
                q, s = quantize(truth[r * per:(r + 1) * per], BLOCK)
                own_exact &= torch.equal(full[r * per:(r + 1) * per], dequantize(q, s, per))
            worst_excess = max(worst_excess, ((full - truth).abs().max() / truth.abs().max()).item())
            everyone = torch.empty(g.shards * full.numel())
            collectives.all_gather(everyone, full, group="shard", phase="test")
            same_across &= all(torch.equal(piece, full) for piece in everyone.chunk(g.shards))
            checked += 1
        unit.reshard()
    return {"checked": checked, "dequant_matches_masters": own_exact, "same_across_ranks": same_across,
            "max_rel_err": worst_excess}


def _errors() -> dict:
    zs.init()
    cfg, _ = w.tiny_setup(w.GLOBAL_BATCH)
    out = {}
    for name, stage, comm in (("weights-stage2", 2, zs.CommQuant(weights=True)),
                              ("weights-stage0", 0, zs.CommQuant(weights=True)),
                              ("grads-stage0", 0, zs.CommQuant(grads=True)),
                              ("grads-stage1", 1, zs.CommQuant(grads=True))):
        try:
            zs.shard(GPT(cfg), stage=stage, comm=comm)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def _quantized_reduce() -> dict:
    """qgZ's building block against the exact reduce-scatter, on real-sized, rank-dependent grads."""
    mesh = zs.init()
    size, per = mesh.shard_size, 3000  # not a multiple of the block: exercises padding
    torch.manual_seed(w.SEED + mesh.rank)
    grads = torch.randn(size * per) * (1 + torch.arange(size * per) % 7)  # blocks of different magnitude
    everyone = torch.empty(size * grads.numel())
    collectives.all_gather(everyone, grads, group="shard", phase="test")
    exact = everyone.view(size, size, per).sum(dim=0)[mesh.shard_rank]
    # Bound: each sender's half step in its block of this rank's piece, summed over senders.
    bound = torch.zeros(per)
    for sender in everyone.view(size, size, per):
        piece = torch.zeros(num_blocks(per, BLOCK) * BLOCK)
        piece[:per] = sender[mesh.shard_rank]
        bound += (piece.view(-1, BLOCK).abs().amax(dim=1) / 127 / 2).repeat_interleave(BLOCK)[:per]
    ledger = zs.ledger()
    start = ledger.next_seq
    out = torch.empty(per)
    quantized_reduce_scatter(out, grads, BLOCK, group="shard", phase="qgz")
    records = list(ledger.since(start))
    return {"within_bound": bool(torch.all((out - exact).abs() <= bound * (1 + 1e-5) + 1e-6)),
            "rms_rel": ((out - exact).norm() / exact.norm()).item(),
            "ops": sorted({r.op for r in records}), "bytes": sum(r.bytes for r in records),
            "formula": size * wire_bytes(per, BLOCK),
            "drift": {name: _summed_drift(grads, fb) for name, fb in (("plain", None), ("ef", ErrorFeedback()))}}


def _summed_drift(grads: torch.Tensor, feedback, steps: int = 100) -> dict:
    """Reduce the same grads ``steps`` times; max |sum of the reduced - steps x the exact sum| on this
    rank's shard. Small values sit below half a step of their block (one large value per block), so
    plain rounding loses them every step; error feedback sends them once they add up."""
    size, rank = collectives.group_size("shard"), get_mesh().shard_rank
    g = grads * 1e-3
    g[::BLOCK] = grads[::BLOCK].abs() + 10
    everyone = torch.empty(size * g.numel())
    collectives.all_gather(everyone, g, group="shard", phase="test")
    per_sender = everyone.view(size, size, -1)[:, rank]  # what each sender holds of this rank's shard
    want = per_sender.sum(dim=0)
    # With feedback: each sender's last rounding error, at most half a step of its (corrected) block.
    padded = torch.zeros(size, num_blocks(want.numel(), BLOCK) * BLOCK)
    padded[:, :want.numel()] = per_sender
    bound = (padded.view(size, -1, BLOCK).abs().amax(dim=2).amax(dim=0) / 127 / 2 * size * 1.01).max().item()
    total, out = torch.zeros_like(want), torch.empty_like(want)
    for _ in range(steps):
        quantized_reduce_scatter(out, g, BLOCK, group="shard", phase="qgz-ef", feedback=feedback)
        total += out
    return {"drift": (total - steps * want).abs().max().item(), "bound": bound}


def quant_suite() -> dict:
    comm = zs.CommQuant(weights=True, block_size=BLOCK)
    fp32 = w.sharded_run(3, w.STEPS, w.GLOBAL_BATCH)
    qwz = w.sharded_run(3, w.STEPS, w.GLOBAL_BATCH, comm=comm)
    both = w.sharded_run(3, w.STEPS, w.GLOBAL_BATCH, comm=zs.CommQuant(weights=True, grads=True, block_size=BLOCK))
    fp32_s2 = w.sharded_run(2, w.STEPS, w.GLOBAL_BATCH)
    qgz_s2 = w.sharded_run(2, w.STEPS, w.GLOBAL_BATCH, comm=zs.CommQuant(grads=True, block_size=BLOCK))
    mesh = zs.init()
    cfg, _ = w.tiny_setup(w.GLOBAL_BATCH)
    torch.manual_seed(w.SEED)
    model = zs.shard(GPT(cfg), stage=3, comm=comm)
    model(*collate(w.tiny_setup(w.GLOBAL_BATCH)[1], list(range(mesh.rank * 4, mesh.rank * 4 + 4)))).backward()
    return {
        "fp32_losses": fp32["losses"], "qwz_losses": qwz["losses"],
        "fp32_step_bytes": fp32["step_bytes"], "qwz_step_bytes": qwz["step_bytes"],
        "both_losses": both["losses"], "fp32_s2_losses": fp32_s2["losses"], "qgz_s2_losses": qgz_s2["losses"],
        "ledger_qg": _one_step_bytes(zs.CommQuant(weights=True, grads=True, block_size=BLOCK)),
        "ledger_ef": _one_step_bytes(zs.CommQuant(weights=True, grads=True, error_feedback=True, block_size=BLOCK)),
        "ef_losses": w.sharded_run(3, w.STEPS, w.GLOBAL_BATCH, comm=zs.CommQuant(
            weights=True, grads=True, error_feedback=True, block_size=BLOCK))["losses"],
        "param_diff": max((fp32["params"][k] - qwz["params"][k]).abs().max().item() for k in fp32["params"]),
        "consistency": _gather_consistency(model),
        "ledger_q": _one_step_bytes(comm),
        "errors": _errors(),
        "qgz": _quantized_reduce(),
    }


def hybrid_quant_suite() -> dict:
    """World 4 as 2 replicas x 2 shards: qwZ+qgZ against fp32 comm, a few steps."""
    zs.init(shard_size=2)
    fp32 = w.sharded_run(3, 6, w.GLOBAL_BATCH)
    quant = w.sharded_run(3, 6, w.GLOBAL_BATCH, comm=zs.CommQuant(weights=True, grads=True, block_size=BLOCK))
    return {"fp32": fp32["losses"], "quant": quant["losses"]}
