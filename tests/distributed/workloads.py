"""Worker functions for the distributed tests (module level so spawned processes can import them).

Each worker runs many cases inside one process group and returns plain data to the parent, because
starting a gloo world costs seconds per process on this machine.
"""

from __future__ import annotations

import torch

import zeroshard as zs
from zeroshard.trainer import step
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.data import build_dataset, collate
from zeroshard.models import GPT, GPTConfig
from reference_steps import plain_adamw_steps

SEED = 1234
LR = 1e-3
WEIGHT_DECAY = 0.1
CLIP = 1.0


def tiny_setup(global_batch: int, seq_len: int = 32, num_samples: int = 256):
    cfg = GPTConfig.named("tiny", seq_len=seq_len)
    data = build_dataset(seq_len=seq_len, num_samples=num_samples, seed=SEED)
    return cfg, data


def reference_run(steps: int, global_batch: int) -> dict:
    """Plain single-process PyTorch: the numerical ground truth."""
    cfg, data = tiny_setup(global_batch)
    torch.manual_seed(SEED)
    model = GPT(cfg)
    losses = plain_adamw_steps(model, data, lambda m, x, y: m(x, y), steps=steps, global_batch=global_batch,
                               seed=SEED, lr=LR, weight_decay=WEIGHT_DECAY, clip=CLIP)
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def tiny_run(stage: int, global_batch: int, *, clip: float = CLIP, weight_decay: float = WEIGHT_DECAY,
             mesh=None, **shard_kwargs):
    """A `zeroshard.trainer.step.Run` of tiny on this world, built the way `zeroshard train` builds one, with
    a constant LR (no warm-up, `min_lr == lr`), on ``mesh`` (the default one unless given);
    ``shard_kwargs`` go to ``zs.shard``."""
    cfg, data = tiny_setup(global_batch)
    mesh = mesh or zs.get_mesh()
    train_cfg = TrainConfig(stage=stage, nproc=mesh.world, batch=global_batch, seq_len=cfg.seq_len,
                            lr=LR, min_lr=LR, warmup=0, weight_decay=weight_decay, clip=clip, seed=SEED)
    torch.manual_seed(SEED)
    return step.build(train_cfg, mesh, model=GPT(cfg), dataset=data, **shard_kwargs)


def max_param_diff(a: dict, b: dict) -> float:
    """Largest elementwise difference between two state dicts with the same keys."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


def next_batch(run):
    return collate(run.dataset, run.sampler.next_indices())


def global_mean_loss(loss_sum: torch.Tensor, y: torch.Tensor) -> float:
    """The global batch's mean token loss (every rank's summed loss over every rank's tokens)."""
    totals = torch.stack([loss_sum, (y != -100).sum().double()])
    zs.comm.collectives.all_reduce(totals, op="sum", phase="metrics")
    return float(totals[0] / totals[1])


def training_records(ledger, start: int):
    """The ledger's records since ``start``, less the step's own metric all-reduce (the token count)
    and the non-finite guard's flag (runtime/guard.py): what the engine itself sends."""
    return [r for r in ledger.since(start) if r.phase not in (step.METRICS_PHASE, "guard")]


def sharded_run(stage: int, steps: int, global_batch: int, **shard_kwargs) -> dict:
    """``steps`` AdamW steps of tiny with global clipping; ``shard_kwargs`` go to ``zs.shard``."""
    zs.init()
    run = tiny_run(stage, global_batch, **shard_kwargs)
    ledger = zs.ledger()
    losses, step_bytes = [], []
    for _ in range(steps):
        x, y = next_batch(run)
        before = {op: ledger.total_bytes(op) for op in ("all_reduce", "reduce_scatter", "all_gather")}
        out = step.step(run, x, y)
        step_bytes.append({op: ledger.total_bytes(op) - b for op, b in before.items()})
        losses.append(global_mean_loss(out.loss_sum, y))
    return {"losses": losses, "params": zs.full_state_dict(run.model), "step_bytes": step_bytes}


STEPS = 20
GLOBAL_BATCH = 8


def parity_suite() -> dict:
    """Stages 0-3 in fp32 on this world, plus stage 0 and 3 with bf16 compute."""
    results = {stage: sharded_run(stage, STEPS, GLOBAL_BATCH) for stage in (0, 1, 2, 3)}
    for stage in (0, 3):
        bf16 = zs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        results[f"bf16-{stage}"] = sharded_run(stage, STEPS, GLOBAL_BATCH, mp=bf16)
    return results


def _unique_storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def memory_probe(stage: int, prefetch: int = 1, reshard_after_forward: bool = True) -> dict:
    """Storage actually held for params, grads and optimizer state after one step, plus stage-3
    full-param residency, read from the storages rather than from bookkeeping."""
    from zeroshard.runtime import get_engine

    zs.init()
    run = tiny_run(stage, GLOBAL_BATCH, clip=0.0, prefetch=prefetch, reshard_after_forward=reshard_after_forward)
    model, opt = run.model, run.opt
    engine = get_engine(model)
    x, y = next_batch(run)
    engine.reset_memory_stats()
    held: dict = {}

    def read_grads() -> None:  # after the optimizer step, before the grads are zeroed
        held["grads"] = [g.grad_full for g in engine.groups] + [g.grad_shard for g in engine.groups]

    step.step(run, x, y, before_zero_grad=read_grads)
    groups = engine.groups
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    params = [g.full for g in groups] + [g.shard for g in groups] + list(model.parameters())
    grads = held.pop("grads")
    out = {
        "padded_numel": sum(g.layout.numel for g in groups),
        "shard_numel": sum(g.layout.shard_numel for g in groups),
        "param_numel": sum(g.layout.param_numel for g in groups),
        "param_bytes": _unique_storage_bytes(params),
        "grad_bytes": _unique_storage_bytes(grads),
        "optim_bytes": _unique_storage_bytes(state),
        "all_bytes": _unique_storage_bytes(params + grads + state),
        "full_bytes_after_step": engine.live_full_bytes(),
        "peak_full_bytes": engine.peak_full_bytes,
        "max_unsharded_units": engine.max_unsharded_units,
        "unit_bytes": {u.name: sum(g.layout.numel * g.full.element_size() for g in u.groups) for u in engine.units},
        "root_unit": next(u.name for u in engine.units if u.is_root),
    }
    del grads
    return out


def memory_suite() -> dict:
    cases = {stage: memory_probe(stage) for stage in (0, 1, 2, 3)}
    cases["3-prefetch2"] = memory_probe(3, prefetch=2)
    cases["3-prefetch0"] = memory_probe(3, prefetch=0)
    cases["3-keep"] = memory_probe(3, reshard_after_forward=False)
    return cases


def ledger_suite() -> dict:
    """Per-phase collective bytes of one training step at each stage (and stage 3 in bf16)."""
    from zeroshard.runtime import get_engine

    out = {}
    bf16 = zs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for stage, mp in ((0, None), (1, None), (2, None), (3, None), ("3-bf16", bf16)):
        zs.init()
        run = tiny_run(3 if stage == "3-bf16" else stage, GLOBAL_BATCH, clip=0.0, mp=mp)
        engine = get_engine(run.model)
        ledger = zs.ledger()
        for _ in range(2):  # step 0 records the order; step 1 runs with prefetch
            x, y = next_batch(run)
            start = ledger.next_seq
            step.step(run, x, y)
        by_phase: dict[str, int] = {}
        for record in training_records(ledger, start):
            key = f"{record.op}:{record.phase}"
            by_phase[key] = by_phase.get(key, 0) + record.bytes
        out[stage] = {
            "by_phase": by_phase,
            "padded_bytes": sum(g.layout.numel * 4 for g in engine.groups),
            "root_bytes": sum(g.layout.numel * 4 for u in engine.units if u.is_root for g in u.groups),
            "kept_bytes": sum(g.layout.numel * 4 for u in engine.kept_for_backward() for g in u.groups)
            if stage in (3, "3-bf16") else 0,
            "psi": sum(g.layout.param_numel for g in engine.groups),
            "groups_named": sorted({r.group for r in training_records(ledger, start)}),
        }
    return out


def comm_memory_suite() -> dict:
    """`ledger_suite` then `memory_suite` in one process group (each case builds its own model and
    reads the ledger from its own start), so test_comm_memory.py pays for one gloo world."""
    return {"ledger": ledger_suite(), "memory": memory_suite()}


def hybrid_suite(shard_size: int = 2) -> dict:
    """World 4 as 2 replicas x 2 shards: parity runs, plus one step's bytes per (op, group, phase)."""
    from zeroshard.runtime import get_engine

    zs.init(shard_size=shard_size)
    out = {stage: sharded_run(stage, 10, GLOBAL_BATCH) for stage in (0, 1, 2, 3)}
    mesh = zs.get_mesh()
    run = tiny_run(3, GLOBAL_BATCH, clip=0.0)
    engine = get_engine(run.model)
    ledger = zs.ledger()
    for _ in range(2):
        x, y = next_batch(run)
        start = ledger.next_seq
        step.step(run, x, y)
    by_key: dict[str, int] = {}
    for record in training_records(ledger, start):
        key = f"{record.op}:{record.group}:{record.phase}"
        by_key[key] = by_key.get(key, 0) + record.bytes
    out["ledger"] = {
        "by_key": by_key,
        "padded_bytes": sum(g.layout.numel * 4 for g in engine.groups),
        "shard_bytes": sum(g.layout.shard_numel * 4 for g in engine.groups),
        "root_bytes": sum(g.layout.numel * 4 for u in engine.units if u.is_root for g in u.groups),
        "kept_bytes": sum(g.layout.numel * 4 for u in engine.kept_for_backward() for g in u.groups),
        "mesh": mesh.describe(),
    }
    return out


def two_meshes_suite(steps: int = 10) -> dict:
    """World 4 holding two sharded models at once: one on the default mesh (shard 4), one on a
    mesh of its own (replicate 2 x shard 2). Their steps interleave, so each one's collectives run
    between the other's; each must still train exactly as it would alone."""
    zs.init()
    hybrid = zs.new_mesh(shard_size=2, name="hybrid")
    runs = {"full": tiny_run(3, GLOBAL_BATCH), "hybrid": tiny_run(3, GLOBAL_BATCH, mesh=hybrid),
            "hybrid-stage1": tiny_run(1, GLOBAL_BATCH, mesh=hybrid)}
    ledger = zs.ledger()
    start = ledger.next_seq
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, run in runs.items():
            x, y = next_batch(run)
            out = step.step(run, x, y)
            losses[name].append(global_mean_loss(out.loss_sum, y))
    seen: dict[str, set] = {}
    for record in training_records(ledger, start):
        seen.setdefault(record.mesh, set()).add(record.group)
    return {"params": {name: zs.full_state_dict(run.model) for name, run in runs.items()}, "losses": losses,
            "groups_by_mesh": seen, "meshes": {name: zs.mesh_of(run.model).describe() for name, run in runs.items()}}


CHECKPOINT_POLICIES = ("none", "all", "every:3", "sqrt")


def checkpointing_suite() -> dict:
    """Every stage x policy for a few steps, plus the recompute all-gathers the ledger saw."""
    out = {}
    ledger = zs.ledger()
    for stage in (0, 1, 2, 3):
        for policy in CHECKPOINT_POLICIES:
            start = ledger.next_seq
            run = sharded_run(stage, 4, GLOBAL_BATCH, checkpointing=policy)
            run["recompute_gather_bytes"] = sum(r.bytes for r in ledger.since(start) if r.phase == "recompute")
            out[(stage, policy)] = run
    return out


def activation_memory(n_layer: int, policy: str, n_embd: int = 64, batch: int = 4, seq: int = 64) -> dict:
    """Activation bytes kept after forward and at the step's peak (torch's MemTracker)."""
    from zeroshard.observing.profile.activations import activation_bytes

    mesh = zs.init()
    cfg = GPTConfig.named("tiny", n_layer=n_layer, n_embd=n_embd, n_head=4, seq_len=seq)
    torch.manual_seed(SEED)
    model = zs.shard(GPT(cfg), stage=0, checkpointing=policy)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    model(x, x).backward()  # warm-up: lazily created buffers are not activations
    return activation_bytes(model, lambda: model(x, x), mesh.device)


def activation_memory_suite(depths: tuple[int, ...], policies: tuple[str, ...]) -> dict:
    """`activation_memory` for every (depth, policy), one after the other in this one process:
    each case builds a fresh model and its own tracker, so it measures the same as a process alone."""
    return {(n_layer, policy): activation_memory(n_layer, policy) for n_layer in depths for policy in policies}
