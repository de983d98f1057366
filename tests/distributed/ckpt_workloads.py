"""Workers for the checkpoint tests (module level so spawned ranks can import them).

One spawned world per phase: the world-4 "save" world runs the continuous reference and the first
half of every resumed run, then fresh worlds (a new process group each) resume from its files.
"""

from __future__ import annotations

from pathlib import Path

import torch

import zeroshard as zs
from zeroshard.comm import collectives
from zeroshard.trainer.data import GlobalBatchSampler, build_dataset, collate
from zeroshard.models import GPT, GPTConfig

SEED = 1234
K = 3                      # steps before the save; the continuous run does 2K
GLOBAL_BATCH = 8
SEQ_LEN = 32
LR = 3e-3
CLIP = 1.0
SAVED_STAGES = (0, 1, 2, 3)


def lr_lambda(step: int) -> float:
    # Warm-up then decay, so a scheduler that resumed at the wrong step changes the update.
    return min(1.0, (step + 1) / 2) / (1 + 0.2 * step)


def build(stage: int):
    mesh = zs.init()
    cfg = GPTConfig.named("tiny", seq_len=SEQ_LEN)
    data = build_dataset(seq_len=SEQ_LEN, num_samples=256, seed=SEED)
    torch.manual_seed(SEED)
    model = zs.shard(GPT(cfg), stage=stage)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, world=mesh.world, rank=mesh.rank, seed=SEED)
    return model, opt, sched, sampler, data


def train(model, opt, sched, sampler, data, steps: int, snapshot_after: int | None = None) -> dict:
    """Run ``steps`` steps; record the global mean loss, the samples every rank actually consumed
    (in rank order) and, after step ``snapshot_after``, the full params."""
    losses, consumed, snapshot = [], [], None
    for step in range(1, steps + 1):
        mine = sampler.next_indices()
        consumed.append([i for part in collectives.all_gather_object(mine) for i in part])
        x, y = collate(data, mine)
        loss = model(x, y)
        loss.backward()
        zs.clip_grad_norm_(model, CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        collectives.all_reduce(mean, op="avg", phase="metrics")
        losses.append(mean.item())
        if step == snapshot_after:
            snapshot = zs.full_state_dict(model)
    return {"losses": losses, "consumed": consumed, "after_first": snapshot, "params": zs.full_state_dict(model)}


def save_world(root: str) -> dict:
    """World 4: the continuous 2K-step reference per stage, and K steps + save per stage."""
    out = {}
    for stage in SAVED_STAGES:
        out[("continuous", stage)] = train(*build(stage), steps=2 * K, snapshot_after=K + 1)
        model, opt, sched, sampler, data = build(stage)
        out[("first_half", stage)] = train(model, opt, sched, sampler, data, steps=K)
        zs.save(Path(root) / f"stage{stage}" / f"step-{K}", model, opt, scheduler=sched, sampler=sampler,
                step=K, extra={"note": "first half"})
    return out if zs.get_mesh().rank == 0 else {}


def resume_world(root: str, cases: list[tuple[int, int]]) -> dict:
    """A fresh process group: for each (saved stage, stage now) load and run the second half."""
    out = {}
    for saved, stage in cases:
        model, opt, sched, sampler, data = build(stage)
        loaded = zs.load(Path(root) / f"stage{saved}", model, opt, scheduler=sched, sampler=sampler)
        result = train(model, opt, sched, sampler, data, steps=K, snapshot_after=1)
        result.update(step=loaded.step, extra=loaded.extra, saved_world=loaded.saved_world,
                      lr_after=[g["lr"] for g in opt.param_groups])
        out[(saved, stage)] = result
    return out if zs.get_mesh().rank == 0 else {}


def error_world(root: str, corrupt: str) -> dict:
    """Errors every rank must raise together (world 2), each naming its cause."""
    out = {}
    zs.init()
    torch.manual_seed(SEED)
    wrong = zs.shard(GPT(GPTConfig.named("tiny", seq_len=SEQ_LEN, n_embd=128)), stage=3)
    for name, call in (
        ("shape", lambda: zs.load(Path(root) / "stage3", wrong)),
        ("corrupt", lambda: zs.load(corrupt, *build(2)[:2])),
        ("exists", lambda: zs.save(Path(root) / "stage3" / f"step-{K}", *build(2)[:2])),
    ):
        try:
            call()
            out[name] = None
        except zs.CheckpointError as e:
            out[name] = str(e)
    return out


def make_checkpoint(path: str, model_name: str) -> dict:
    """One process, stage 0: a model-only checkpoint of ``model_name`` (for the export memory test)."""
    zs.init()
    torch.manual_seed(SEED)
    model = zs.shard(GPT(GPTConfig.named(model_name)), stage=0)
    zs.save(path, model, step=0)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return {"model_bytes": sum(sizes), "largest_param_bytes": max(sizes)}


def resume_world_and(root: str, cases: list[tuple[int, int]], also: dict[str, str]) -> dict:
    """`resume_world`, then in the same process group the cases named in ``also``: ``corrupt`` (a
    damaged copy) runs `error_world`, ``small`` (a path) runs `make_checkpoint` of small. A gloo world
    costs seconds per process here, so each resize world also serves the tests that need one."""
    out = {"resume": resume_world(root, cases)}
    if "corrupt" in also:
        out["errors"] = error_world(root, also["corrupt"])
    if "small" in also:
        out["small"] = make_checkpoint(also["small"], "small")
    return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def export_peak(src: str, out: str) -> dict:
    """Export in this (fresh) process; report how far its peak RSS rose above the RSS before it.

    Writing 5 to /proc/self/clear_refs resets the kernel's high-water mark (VmHWM), so the peak is
    the export's own and not an earlier transient such as importing torch.
    """
    from zeroshard.checkpoint import export

    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    stats = export(src, out)
    peak = _status_kib("VmHWM")
    return {"peak_rise_bytes": (peak - before) * 1024, "bytes": stats.bytes,
            "largest_param_bytes": stats.largest_param_bytes}
