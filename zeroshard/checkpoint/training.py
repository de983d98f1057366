"""Checkpointing for ``zeroshard train``: ``--save-every K --ckpt-dir D --resume auto``.

The training loop holds one :class:`TrainingCheckpoints` and knows nothing else about
checkpoints: ``resume()`` before the first step (returns the step to continue from) and
``after_step(step)`` after each.

Resume is strict: ``--resume auto`` over a directory that holds checkpoints of which none verifies
is an error naming each and its fault, never a silent fresh start (whose rotation would then
delete them). ``--resume fresh-ok`` is the same search, but starts from step 0 when none verifies.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import IO, Any, Callable

from zeroshard.checkpoint.async_save import finish_previous
from zeroshard.checkpoint.discover import choose, complete_checkpoints
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.load import Loaded, load
from zeroshard.checkpoint.resize import Resize, plan_resize
from zeroshard.checkpoint.save import save
from zeroshard.parallel.pipeline.schedules import microbatches_of
from zeroshard.comm import collectives

AUTO = "auto"
FRESH_OK = "fresh-ok"
SEARCHES = (AUTO, FRESH_OK)
"""``resume`` values that search ``ckpt_dir`` instead of naming a checkpoint."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def _say(line: str) -> None:
    print(f"zeroshard train: {line}", flush=True)


def _layout(world: int, stage: int, ep: int, pp: int = 1) -> str:
    return (f"{world} ranks at stage {stage}" + (f", experts split over ep {ep}" if ep > 1 else "")
            + (f", in pp {pp} pipeline stages" if pp > 1 else ""))


def new_lineage() -> str:
    """A run's id, recorded in every checkpoint it (and every resume of it) writes."""
    return uuid.uuid4().hex[:16]


def search(root: str | Path, mode: str, log: Callable[[str], None] = _say) -> tuple[str | None, str | None]:
    """(checkpoint to resume from or None for a fresh start, the refusal or None) of ``--resume
    auto`` (strict) or ``fresh-ok`` over ``root``; needs no process group."""
    choice = choose(root)
    for line in choice.describe():
        log(f"resume: {line}")
    if choice.path is not None:
        return str(choice.path), None
    if choice.faults and mode == AUTO:
        return None, choice.refusal(root)
    if choice.faults:
        log(f"resume: --resume {FRESH_OK}: starting from step 0; the checkpoints that do not verify are kept")
    return None, None


class TrainingCheckpoints:
    """The checkpoints of one training run (every rank holds one; calls are collective)."""

    def __init__(self, run: Any, log: Callable[[str], None] = _say) -> None:
        self.run = run
        self.log = log
        self.lineage = new_lineage()
        """Kept across resumes: a resumed run adopts the lineage of the checkpoint it loaded."""
        self.loaded: Loaded | None = None
        self.resize: Resize | None = None
        """Set when the run resumed on another data-parallel world (zeroshard/checkpoint/resize.py)."""

    def resume(self) -> int:
        """Restore the run from ``cfg.resume`` (collective); the global step to continue from, 0 if fresh."""
        cfg = self.run.cfg
        if cfg.resume is None:
            if cfg.save_every and cfg.ckpt_dir and complete_checkpoints(cfg.ckpt_dir):
                # Saving would replace them step by step; a fresh run almost never means that.
                raise CheckpointError(f"ckpt_dir {cfg.ckpt_dir} already holds checkpoints; pass --resume auto to "
                                      "continue from them, or use an empty --ckpt-dir for a fresh run")
            return 0
        path = self._search() if cfg.resume in SEARCHES else Path(cfg.resume)
        if path is None:
            return 0
        return self._load(path)

    def _search(self) -> Path | None:
        """The checkpoint ``--resume auto`` picks (None: start fresh), the same on every rank."""
        cfg = self.run.cfg
        # Rank 0 verifies every candidate (a full checksum pass); the others follow its choice.
        picked: tuple[str | None, str | None] = (None, None)
        if self.run.mesh.rank == 0:
            picked = search(cfg.ckpt_dir, cfg.resume, self.log)
        path, refusal = collectives.all_gather_object(picked, phase="checkpoint")[0]
        if refusal is not None:
            raise CheckpointError(refusal)
        return None if path is None else Path(path)

    def newest_verified(self) -> Path | None:
        """The newest checkpoint in ``ckpt_dir`` that verifies, the same on every rank (collective); a
        spike rollback's target."""
        picked: tuple[str | None, str | None] = (None, None)
        if self.run.mesh.rank == 0:
            picked = search(self.run.cfg.ckpt_dir, FRESH_OK, lambda line: None)
        path, _ = collectives.all_gather_object(picked, phase="checkpoint")[0]
        return None if path is None else Path(path)

    def restore(self, path: Path) -> int:
        """Load ``path`` into the running run (collective), as a resume does; the step it holds."""
        return self._load(path)

    def _load(self, path: Path) -> int:
        run, cfg = self.run, self.run.cfg
        model, opt = saved_state(run)
        loaded = load(path, model, opt, scheduler=getattr(run, "scheduler", None), sampler=run.sampler,
                      scaler=getattr(run, "scaler", None))
        if loaded.step is None:
            raise CheckpointError(f"checkpoint {loaded.path} records no step, so training cannot continue from it")
        if loaded.step >= cfg.steps:
            raise CheckpointError(f"checkpoint {loaded.path} is at step {loaded.step}, which already reaches "
                                  f"steps={cfg.steps}; raise --steps to train further")
        if run.mesh.rank == 0:
            manifest = loaded.manifest or {}
            saved_ep = (manifest.get("mesh") or {}).get("ep_size", 1)
            saved_pp = (manifest.get("pipeline") or {}).get("pp", 1)
            self.log(f"resumed from {loaded.path} at step {loaded.step} (saved on "
                     f"{_layout(loaded.saved_world, loaded.saved_stage, saved_ep, saved_pp)}; now "
                     f"{_layout(run.mesh.world, cfg.stage, run.mesh.ep_size, run.mesh.pp_size)})")
        self.loaded = loaded
        if loaded.lineage is not None:
            self.lineage = loaded.lineage
        self._keep_global_batch(loaded)
        return loaded.step

    def _keep_global_batch(self, loaded: Loaded) -> None:
        """On another data-parallel world, change accumulation so the global batch stays (resize.py)."""
        run = self.run
        saved = loaded.extra.get("train") if isinstance(loaded.extra, dict) else None
        if not isinstance(saved, dict) or "nproc" not in saved or loaded.step is None:
            return  # saved by a loop of its own: its batch is the caller's business
        saved_dp = saved["nproc"] // saved.get("tp", 1) // saved.get("pp", 1)  # ranks that saw different data
        saved_mb = microbatches_of(saved.get("pp", 1), schedule=saved.get("pp_schedule", "1f1b"),
                                   microbatches=saved.get("microbatches", 0),
                                   stages_per_rank_asked=saved.get("pp_stages_per_rank", 0))
        self.resize = plan_resize(step=loaded.step, batch=run.cfg.batch, saved_world=saved_dp,
                                  saved_accum=saved.get("accum", 1), world=run.mesh.dp_size,
                                  saved_microbatches=saved_mb,
                                  microbatches=run.pipeline.microbatches if run.pipeline is not None else 1)
        if self.resize is None:
            return
        run.cfg = dataclasses.replace(run.cfg, accum=self.resize.to_accum)
        if run.mesh.rank == 0:
            self.log(self.resize.describe())

    def step_fields(self) -> dict[str, int]:
        """Fields each metrics.jsonl record after a resize carries: the world and accumulation it ran."""
        if self.resize is None:
            return {}
        return {"world": self.resize.to_world, "accum": self.resize.to_accum}

    def record_resize(self, summary: dict[str, Any], run_dir: Path) -> None:
        """Put the resize, if any, into the run's summary and its summary.json (rank 0 writes it)."""
        if self.resize is None:
            return
        summary["resize"] = self.resize.as_dict()
        path = run_dir / "summary.json"
        if self.run.mesh.rank == 0 and path.is_file():
            path.write_text(json.dumps(dict(json.loads(path.read_text()), resize=summary["resize"]), indent=2) + "\n")

    def after_step(self, step: int) -> None:
        """Save after global step ``step`` (1-based) when it is a multiple of ``save_every`` (collective).
        With ``save_async`` it returns once the state is copied to host memory."""
        run, cfg = self.run, self.run.cfg
        if not cfg.save_every or step % cfg.save_every:
            return
        # overwrite=True: a resumed run replays the steps after its checkpoint, and what it saves
        # supersedes a verified checkpoint of the abandoned attempt; one that does not verify is set
        # aside instead (zeroshard/checkpoint/rotation.py).
        model, opt = saved_state(run)
        save(Path(cfg.ckpt_dir) / checkpoint_name(step), model, opt,
             scheduler=getattr(run, "scheduler", None), sampler=run.sampler,
             scaler=getattr(run, "scaler", None), extra={"train": cfg.to_dict()}, step=step,
             keep_last=cfg.keep_last or None, overwrite=True, lineage=self.lineage, log=self.log,
             async_=cfg.save_async, timeout_s=cfg.hang_timeout_s)

    def close(self) -> None:
        """Finish an asynchronous save still in flight (collective with ``save_async``: every rank
        fails if one did)."""
        if not self.run.cfg.save_async:
            return
        problem = finish_previous()
        problems = collectives.all_gather_object(problem, phase="checkpoint")
        first = next((p for p in problems if p), None)
        if first:
            raise CheckpointError(first)


def saved_state(run: Any) -> tuple[Any, Any]:
    """(model, optimizer) as ``zs.save``/``zs.load`` take them: under pp the rank's ``Pipeline`` and
    its per-stage optimizers (``run.opt`` drives them as one), else the sharded model and its optimizer."""
    if run.pipeline is None:
        return run.model, run.opt
    return run.pipeline, run.opt.items


def open_metrics(path: Path, start: int) -> IO[str]:
    """The metrics file for a run that starts at step ``start``: after a resume, the records of
    steps past the checkpoint (an abandoned attempt) are dropped, so each step appears once."""
    if not start or not path.exists():
        return path.open("w")
    # The header line (zs.observe's first, without a step) is kept with the steps up to the checkpoint.
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= start]
    path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")
