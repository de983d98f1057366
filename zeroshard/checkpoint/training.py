"""Checkpointing for ``zeroshard train``: ``--save-every K --ckpt-dir D --resume auto``.

The training loop calls two functions and knows nothing else about checkpoints: ``resume(run)``
before the first step (returns the step to continue from) and ``maybe_save(run, step)`` after each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, Callable

from zeroshard.checkpoint.discover import choose, complete_checkpoints
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.load import load
from zeroshard.checkpoint.save import save
from zeroshard.comm import collectives


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def _say(line: str) -> None:
    print(f"zeroshard train: {line}", flush=True)


def resume(run: Any, log: Callable[[str], None] = _say) -> int:
    """Restore ``run`` from ``cfg.resume`` (collective); the global step to continue from, 0 if fresh."""
    cfg = run.cfg
    rank = run.mesh.rank
    if cfg.resume is None:
        if cfg.save_every and cfg.ckpt_dir and complete_checkpoints(cfg.ckpt_dir):
            # Saving would replace them step by step; a fresh run almost never means that.
            raise CheckpointError(f"ckpt_dir {cfg.ckpt_dir} already holds checkpoints; pass --resume auto to "
                                  "continue from them, or use an empty --ckpt-dir for a fresh run")
        return 0
    if cfg.resume == "auto":
        # Rank 0 verifies every candidate (a full checksum pass); the others follow its choice.
        picked = None
        if rank == 0:
            choice = choose(cfg.ckpt_dir)
            for line in choice.describe():
                log(f"resume: {line}")
            picked = None if choice.path is None else str(choice.path)
        picked = collectives.all_gather_object(picked, phase="checkpoint")[0]
        if picked is None:
            return 0
        path = Path(picked)
    else:
        path = Path(cfg.resume)
    loaded = load(path, run.model, run.opt, scheduler=getattr(run, "scheduler", None), sampler=run.sampler,
                  scaler=getattr(run, "scaler", None))
    if loaded.step is None:
        raise CheckpointError(f"checkpoint {loaded.path} records no step, so training cannot continue from it")
    if loaded.step >= cfg.steps:
        raise CheckpointError(f"checkpoint {loaded.path} is at step {loaded.step}, which already reaches "
                              f"steps={cfg.steps}; raise --steps to train further")
    if rank == 0:
        log(f"resumed from {loaded.path} at step {loaded.step} (saved on {loaded.saved_world} ranks at stage "
            f"{loaded.saved_stage}; now {run.mesh.world} ranks at stage {cfg.stage})")
    return loaded.step


def open_metrics(path: Path, start: int) -> IO[str]:
    """The metrics file for a run that starts at step ``start``: after a resume, the records of
    steps past the checkpoint (an abandoned attempt) are dropped, so each step appears once."""
    if not start or not path.exists():
        return path.open("w")
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= start]
    path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")


def maybe_save(run: Any, step: int) -> Path | None:
    """Save after global step ``step`` (1-based) when it is a multiple of ``save_every`` (collective)."""
    cfg = run.cfg
    if not cfg.save_every or step % cfg.save_every:
        return None
    # overwrite=True: a resumed run replays the steps after its checkpoint, and what it saves
    # supersedes a checkpoint of the abandoned attempt (e.g. one that failed to verify).
    return save(Path(cfg.ckpt_dir) / checkpoint_name(step), run.model, run.opt,
                scheduler=getattr(run, "scheduler", None), sampler=run.sampler, scaler=getattr(run, "scaler", None),
                extra={"train": cfg.to_dict()}, step=step, keep_last=cfg.keep_last or None, overwrite=True)
