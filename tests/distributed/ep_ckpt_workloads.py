"""Workers for the expert-parallel checkpoint tests: save with experts split over ep 2, resume at ep 1 and ep 4.

One world of 4 holds every mesh at once (``zs.new_mesh``): (shard 2 x ep 2) saves, the plain
world-4 mesh (ep 1, shard 4) and ep 4 resume, directly from the checkpoint and from its offline
``ckpt reshard`` to each ep degree; Mixtral saved at (shard 2 x tp 2) with ep 2 resumes at tp 1 and
at ep 4. Models and configs are ep_workloads' (tiny-moe with its load-balancing loss, HF Mixtral).
Module level so spawned ranks can import it.
"""

from __future__ import annotations

import dataclasses

import torch

import ep_workloads as ew
import zeroshard as zs
from zeroshard.trainer import step
from zeroshard.comm import collectives
from zeroshard.comm.names import Group, Phase
from zeroshard.trainer.data import build_dataset, collate
from zeroshard.runtime.expert_placement import all_experts
from zeroshard.runtime import get_engine
from zeroshard.runtime.tp import full_value

STEPS_BEFORE = 3
"""Steps before the save: AdamW's moments are well away from zero, so a misplaced one shows."""


@dataclasses.dataclass(frozen=True)
class Resume:
    mesh: str  # "ep1" (shard 4), "ep2" (shard 2 x ep 2), "ep4", or (shard 2 x tp 2) with "tp2ep2" / "tp2ep4"
    stage: int
    source: str  # "ep2" (the saved checkpoint itself) or "reshard-epN" (its offline reshard to ep N)


CASES = {"gpt": ew.Case("gpt", 3, "ep2"), "mixtral": ew.Case("mixtral", 2, "ep2"),
         "mixtral-tp": ew.Case("mixtral", 2, "tp2ep2")}
"""What each model saves at (shard 2 x ep 2), and Mixtral at (shard 2 x tp 2) with ep 2 too."""
RESUMES = {
    "gpt": (Resume("ep1", 2, "ep2"), Resume("ep4", 1, "ep2"), Resume("ep1", 3, "reshard-ep1"),
            Resume("ep4", 3, "reshard-ep4"), Resume("ep2", 1, "reshard-ep1")),
    "mixtral": (Resume("ep1", 3, "ep2"), Resume("ep4", 3, "ep2")),
    # ep with tp: to tp 1 (the data-parallel world doubles; Mixtral has no aux loss that it changes)
    # and to ep 4 at tp 2
    "mixtral-tp": (Resume("ep2", 3, "ep2"), Resume("tp2ep4", 1, "ep2")),
}
"""Where each checkpoint resumes; the last gpt one goes back up from a checkpoint without experts
placed (its ep-1 reshard, as an ep-1 run saves it) to ep 2."""
EP = {"ep1": 1, "ep2": 2, "ep4": 4}


def _run(case: ew.Case, mesh, stage: int):
    cfg = dataclasses.replace(ew.train_config(case), stage=stage, tp=mesh.tp_size)
    data = build_dataset(seq_len=ew.SEQ, num_samples=cfg.num_samples, vocab_size=ew.VOCAB, seed=ew.SEED)
    return step.build(cfg, mesh, model=ew.build_model(case), dataset=data)


def _train(run, steps: int) -> None:
    for _ in range(steps):
        x, y = collate(run.dataset, run.sampler.next_indices())
        step.step(run, x, y)


def full_moments(run) -> dict[str, torch.Tensor]:
    """Every trainable param's AdamW moments at full size, by ``name/kind``: each flat group's
    optimizer shard gathered over its shard group, then a tp part over tp and an expert param's
    blocks over ep, as ``full_state_dict`` gathers the masters. Independent of the checkpoint code."""
    engine = get_engine(run.model)
    entries = run.opt.zeroshard_state.segments.entries
    out: dict[str, torch.Tensor] = {}
    for group in engine.groups:
        if not group.trainable:
            continue
        for kind in ("exp_avg", "exp_avg_sq"):
            shard = torch.zeros_like(group.shard)
            for param, owner, start, stop in entries:
                if owner is group:
                    shard[start:stop] = run.opt.state[param][kind]
            whole = shard
            if group.shards > 1:
                whole = torch.empty(group.layout.numel, dtype=shard.dtype)
                collectives.all_gather(whole, shard, group=Group.SHARD, unit=group.unit, phase=Phase.STATE_DICT,
                                       mesh=group.mesh)
            for slot, spec in zip(group.layout.slots, group.tp_specs):
                value = full_value(whole[slot.offset:slot.end].view(slot.shape), spec, mesh=group.mesh)
                out[f"{slot.fqn}/{kind}"] = all_experts(value, group.mesh, unit=group.unit).clone()
    return out


def _save(run, path: str) -> None:
    zs.save(path, run.model, run.opt, scheduler=run.scheduler, sampler=run.sampler, step=STEPS_BEFORE)


def _resume(case: ew.Case, mesh, stage: int, path: str) -> dict:
    """Load ``path`` into a fresh run on ``mesh``: what it holds right after, and after one step."""
    run = _run(case, mesh, stage)
    loaded = zs.load(path, run.model, run.opt, scheduler=run.scheduler, sampler=run.sampler)
    out = {"loaded": zs.full_state_dict(run.model), "moments": full_moments(run), "files": loaded.files_read}
    _train(run, 1)
    out["next"] = zs.full_state_dict(run.model)
    return out


def resume_alone(root: str, name: str, *, stage: int) -> dict:
    """The ep-2 checkpoint of ``name`` resumed on this process's world (of one)."""
    return _resume(CASES[name], zs.get_mesh(), stage, f"{root}/{name}-ep2")


def reshard_offline(root: str, name: str) -> None:
    """What ``zeroshard ckpt reshard --ep`` does, on rank 0 with no process group in use."""
    from zeroshard.checkpoint.export import reshard

    for ep in (1, 4):
        reshard(f"{root}/{name}-ep2", f"{root}/{name}-reshard-ep{ep}", 4, ep=ep)


def suite(root: str) -> dict:
    zs.init()
    meshes = {"ep1": zs.get_mesh(), **{name: zs.new_mesh(**kwargs, name=name) for name, kwargs in ew.MESHES.items()}}
    out: dict = {"rank": meshes["ep1"].rank}
    for name, case in CASES.items():
        run = _run(case, meshes[case.mesh], case.stage)
        _train(run, STEPS_BEFORE)
        _save(run, f"{root}/{name}-ep2")
        got: dict = {"saved": zs.full_state_dict(run.model), "moments": full_moments(run)}
        _train(run, 1)
        got["continuous"] = zs.full_state_dict(run.model)
        if meshes["ep1"].rank == 0 and case.mesh == "ep2":
            reshard_offline(root, name)
        collectives.all_gather_object(None, phase="checkpoint")  # the reshards are written
        for resume in RESUMES[name]:
            got[resume] = _resume(case, meshes[resume.mesh], resume.stage, f"{root}/{name}-{resume.source}")
        out[name] = got
    return out
