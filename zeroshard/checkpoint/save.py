"""``zs.save``: every rank writes its pieces in parallel; rank 0 commits the checkpoint atomically.

The protocol (docs/checkpoints.md, "Atomic commit"):

1. Rank 0 refuses an existing target unless ``overwrite``, and creates the hidden sibling
   ``.<name>.partial``; every rank learns the outcome (an all-gather), so all fail together.
2. Every rank streams its file into the partial directory, hashing as it writes, and fsyncs it.
   Its header carries what rebuilding the manifest needs (zeroshard/checkpoint/rankfile.py).
3. An all-gather brings every rank's file digest and piece list to rank 0 (it is also the barrier
   that says every file is on disk).
4. Rank 0 writes ``manifest.json`` last, fsyncs, sets aside a same-named checkpoint that does not
   verify (a verified one is replaced), renames the directory into place, fsyncs the parent,
   points ``latest`` at it (atomic replace) and rotates to ``keep_last`` (zeroshard/checkpoint/
   rotation.py: only verified checkpoints of the same lineage are ever deleted).
5. A final all-gather tells every rank whether the commit happened.

A crash anywhere before the rename leaves only the partial directory: the previous checkpoint and
``latest`` are untouched, and a resume names the partial one as interrupted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, overload

from torch import nn

from zeroshard.comm import fault_points as faults
from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint import async_save, rankfile, rng
from zeroshard.checkpoint.async_save import PendingSave
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.manifest import assemble, group_entries, param_entries, skeleton
from zeroshard.checkpoint.rotation import Rotation, clear_target, rotate
from zeroshard.checkpoint.stages import Parts, parts_of, placement
from zeroshard.comm import collectives

if TYPE_CHECKING:
    from zeroshard.parallel.pipeline import Pipeline

PHASE = "checkpoint"


def say(line: str) -> None:
    """Where rotation reports what it set aside or deleted, unless the caller passes its own ``log``."""
    print(f"zeroshard checkpoint: {line}", file=sys.stderr, flush=True)


def _agree(problem: str | None) -> None:
    """Every rank raises the same error if any rank has one (so none is left waiting in a collective)."""
    problems = collectives.all_gather_object(problem, phase=PHASE)
    first = next((p for p in problems if p), None)
    if first:
        raise CheckpointError(first)


@overload
def save(path: str | os.PathLike, model: nn.Module | Pipeline, optimizer=None, scheduler=None, sampler=None, scaler=None,
         extra: Any = None, *, step: int | None = None, keep_last: int | None = None, overwrite: bool = False,
         lineage: str | None = None, log: Callable[[str], None] = ..., async_: Literal[False] = False,
         timeout_s: float = ...) -> Path: ...


@overload
def save(path: str | os.PathLike, model: nn.Module | Pipeline, optimizer=None, scheduler=None, sampler=None, scaler=None,
         extra: Any = None, *, step: int | None = None, keep_last: int | None = None, overwrite: bool = False,
         lineage: str | None = None, log: Callable[[str], None] = ..., async_: Literal[True],
         timeout_s: float = ...) -> PendingSave: ...


def save(path: str | os.PathLike, model: nn.Module | Pipeline, optimizer=None, scheduler=None, sampler=None, scaler=None,
         extra: Any = None, *, step: int | None = None, keep_last: int | None = None, overwrite: bool = False,
         lineage: str | None = None, log: Callable[[str], None] = say, async_: bool = False,
         timeout_s: float = 600.0) -> Path | PendingSave:
    """Save the complete training state to the checkpoint directory ``path`` (collective: every rank).

    ``scheduler``, ``sampler`` and ``scaler`` are anything with ``state_dict()``; their state and
    ``extra`` must be JSON-able (numbers, strings, lists, dicts, tuples, 0-dim tensors). ``step`` is
    the global step to record. ``keep_last=K`` rotates after a successful commit: the new checkpoint
    is verified, checkpoints next to it that fail verification are renamed ``<name>.corrupt``, and
    verified ones of the same ``lineage`` (a run's id, recorded in the manifest; None matches None)
    past the K newest are deleted. ``overwrite`` replaces a same-named checkpoint only if it
    verifies; one that does not is set aside. ``log`` gets a line for each thing set aside or
    deleted. Returns the committed directory.

    ``async_=True`` returns as soon as every rank has copied its pieces to host memory and writes,
    hashes and commits in the background (zeroshard/checkpoint/async_save.py); it returns a
    :class:`PendingSave` whose ``wait()`` gives the committed directory or raises. At most one save
    is in flight: the next one (either kind) waits for it first. ``timeout_s`` bounds how long rank
    0 waits for the other ranks' files before giving up on that commit.

    Under pipeline parallelism ``model`` is the rank's ``Pipeline`` and ``optimizer`` the list of its
    per-stage optimizers (``pipe.optimizers(...)``); every stage's pieces go into one checkpoint of
    the whole model, with its pp placement recorded (zeroshard/checkpoint/stages.py).
    """
    parts = parts_of(model, optimizer)
    engine = parts.engine
    target = Target(Path(path), overwrite=overwrite, keep_last=keep_last, lineage=lineage, log=log)
    carried = async_save.finish_previous()  # at most one save in flight: this rank's, finished first
    frame = prepare(target, parts, scheduler, sampler, scaler, extra, step=step, carried=carried)
    if async_:
        return _save_in_background(target, frame, parts, step=step, timeout_s=timeout_s)

    report, problem = None, None
    try:
        report = rankfile.write(target.partial, rankfile.collect_parts(parts), rng_state=rng.capture(),
                                step=step, skeleton=frame)
    except Exception as e:  # noqa: BLE001 - reported to every rank instead of hanging them
        problem = f"rank {engine.mesh.rank} could not write its checkpoint file in {target.partial}: " \
                  f"{type(e).__name__}: {e}"
    reports = collectives.all_gather_object((report, problem), phase=PHASE)
    _agree(next((p for _, p in reports if p), None))

    problem = None
    if engine.mesh.rank == 0:
        assert frame is not None  # rank 0 built it in prepare
        try:
            finish(target, frame, [r for r, _ in reports])
        except Exception as e:  # noqa: BLE001 - reported to every rank instead of hanging them
            problem = f"rank 0 could not commit checkpoint {target.final}: {type(e).__name__}: {e}"
    _agree(problem)
    return target.final


def _save_in_background(target: Target, frame: dict | None, parts: Parts, *, step: int | None,
                        timeout_s: float) -> PendingSave:
    rank, world = parts.engine.mesh.rank, parts.engine.mesh.world
    pieces = async_save.SNAPSHOT.take(rankfile.collect_parts(parts))
    rng_state = rng.capture()  # now, with the state: training goes on drawing random numbers
    pending = PendingSave(target.final, rank)

    def work() -> None:
        report, problem = None, None
        try:
            report = rankfile.write(target.partial, pieces, rng_state=rng_state, step=step, skeleton=frame)
        except Exception as e:  # noqa: BLE001 - posted for rank 0, and kept for this rank's wait()
            problem = f"rank {rank} could not write its checkpoint file in {target.partial}: {type(e).__name__}: {e}"
        async_save.post_report(target.partial, rank, report, problem)
        if problem is not None:
            pending.problem = problem
            return
        if rank == 0:
            assert frame is not None  # rank 0 built it in prepare
            try:
                finish(target, frame, async_save.collect_reports(target.partial, world, timeout_s))
            except Exception as e:  # noqa: BLE001 - kept for wait(); the next save or the run's end reports it
                pending.problem = f"rank 0 could not commit checkpoint {target.final}: {type(e).__name__}: {e}"

    return async_save.start(pending, work)


@dataclasses.dataclass
class Target:
    """Where a save goes and what its commit does."""

    final: Path
    overwrite: bool
    keep_last: int | None
    lineage: str | None
    log: Callable[[str], None]

    @property
    def partial(self) -> Path:
        return self.final.parent / f".{self.final.name}.partial"


def prepare(target: Target, parts: Parts, scheduler, sampler, scaler, extra, *,
            step: int | None, carried: str | None = None) -> dict | None:
    """Step 1 (collective): rank 0 checks the target, makes the partial directory and builds the
    manifest skeleton, which it returns (the other ranks get None); every rank fails together, also
    when a rank ``carried`` the failure of its previous asynchronous save."""
    faults.armed("ckpt.write")  # a malformed ZEROSHARD_CKPT_FAULT fails here, before any file is written
    engine, part = parts.engine, parts.first
    layout, problem = _pipeline_layout(parts) if parts.pipeline is not None else (None, None)
    problem, frame = carried or problem, None
    if engine.mesh.rank == 0 and problem is None:
        try:
            side = _side_state(scheduler, sampler, scaler, extra)
            frame = skeleton(part.module, engine, part.optimizer, step=step, side=side, lineage=target.lineage,
                             layout=layout, model_class=parts.model_class())
            problem = _prepare(target.final, target.partial, target.overwrite)
        except CheckpointError as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - reported to every rank instead of hanging them
            problem = f"cannot save checkpoint {target.final}: {type(e).__name__}: {e}"
    _agree(problem)
    return frame


def _pipeline_layout(parts: Parts) -> tuple[dict | None, str | None]:
    """(the skeleton's params, groups, units and pp placement of every stage, or None; a problem, or
    None) on rank 0, gathered from every rank (collective): rank 0 holds only its own stages."""
    mine, problem = [], None
    try:
        for p in parts.parts:
            params = param_entries(p.module, p.engine, skip=p.skip, aliases=p.aliases)
            mine.append({"stage": p.stage, "params": params, "groups": group_entries(p.engine, skip=p.skip),
                         "units": [u.name for u in p.engine.units],
                         "names": [e["tp"]["of"] if "tp" in e else e["fqn"] for e in params
                                   if "tp" not in e or e["tp"]["rank"] == 0]})
    except Exception as e:  # noqa: BLE001 - reported to every rank instead of hanging them
        problem = f"rank {parts.engine.mesh.rank} could not describe its pipeline stages: {type(e).__name__}: {e}"
    gathered = collectives.all_gather_object((mine, problem), phase=PHASE)
    problem = next((p for _, p in gathered if p), None)
    if problem is not None or parts.engine.mesh.rank != 0:
        return None, problem
    by_stage = {f["stage"]: f for fragments, _ in gathered for f in fragments}
    stages = [by_stage[s] for s in sorted(by_stage)]
    return {"params": [e for f in stages for e in f["params"]], "groups": [g for f in stages for g in f["groups"]],
            "units": [u for f in stages for u in f["units"]], "pipeline": placement(parts, stages)}, None


def finish(target: Target, frame: dict, reports: list[dict]) -> None:
    """Steps 4 (rank 0): write the manifest last, commit, point ``latest`` at it and rotate."""
    fmt.write_manifest(target.partial, assemble(frame, reports))
    rotation = Rotation()
    if target.overwrite:
        clear_target(target.final, rotation)
    commit(target.partial, target.final, overwrite=target.overwrite)
    if target.keep_last:
        rotated = rotate(target.final.parent, target.keep_last, newest=target.final, lineage=target.lineage)
        rotation.set_aside += rotated.set_aside
        rotation.deleted += rotated.deleted
    for line in rotation.describe():
        target.log(line)


def _prepare(final: Path, partial: Path, overwrite: bool) -> str | None:
    if final.exists() and not overwrite:
        return (f"checkpoint {final} already exists; refusing to overwrite it. Save to a new path, "
                "or pass overwrite=True to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    if partial.exists():
        shutil.rmtree(partial)  # left by an interrupted save of the same name; it never committed
    partial.mkdir()
    return None


def _side_state(scheduler, sampler, scaler, extra) -> dict[str, Any]:
    out = {}
    for name, obj in (("scheduler", scheduler), ("sampler", sampler), ("scaler", scaler)):
        out[name] = None if obj is None else fmt.to_json(obj.state_dict(), f"{name}.state_dict()")
    out["extra"] = fmt.to_json(extra, "extra")
    json.dumps(out)  # fail here, before any file is written, if something slipped through
    return out


# --------------------------------------------------------------------------- commit, latest


def commit(partial: Path, final: Path, *, overwrite: bool, latest: bool = True) -> None:
    """Rename the finished partial directory into place and (``latest``) point ``latest`` at it."""
    fmt.fsync_dir(partial)
    old = final.parent / f".{final.name}.old"
    if final.exists():
        if not overwrite:
            raise CheckpointError(f"checkpoint {final} appeared during the save; refusing to overwrite it")
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(partial, final)
    fmt.fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
    if latest:
        write_latest(final)


def write_latest(final: Path) -> None:
    latest = final.parent / fmt.LATEST
    tmp = final.parent / f".{fmt.LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, latest)
    fmt.fsync_dir(final.parent)
