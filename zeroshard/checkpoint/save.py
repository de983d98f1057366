"""``zs.save``: every rank writes its pieces in parallel; rank 0 commits the checkpoint atomically.

The protocol (docs/checkpoints.md, "Atomic commit"):

1. Rank 0 refuses an existing target unless ``overwrite``, and creates the hidden sibling
   ``.<name>.partial``; every rank learns the outcome (an all-gather), so all fail together.
2. Every rank streams its file into the partial directory, hashing as it writes, and fsyncs it.
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

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint import rng
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.rotation import Rotation, clear_target, rotate
from zeroshard.checkpoint.pieces import (TP_PART, SegmentIndex, ordered_refs, owned_slots, persistent_buffers,
                                         saved_name, split_state, writer_range)
from zeroshard.checkpoint.tensorfile import Entry, TensorFileWriter, dtype_name
from zeroshard import faults
from zeroshard.comm import collectives
from zeroshard.sharding.engine import Engine, get_engine
from zeroshard.sharding.optim import user_class


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


def save(path: str | os.PathLike, model: nn.Module, optimizer=None, scheduler=None, sampler=None, scaler=None,
         extra: Any = None, *, step: int | None = None, keep_last: int | None = None,
         overwrite: bool = False, lineage: str | None = None, log: Callable[[str], None] = say) -> Path:
    """Save the complete training state to the checkpoint directory ``path`` (collective: every rank).

    ``scheduler``, ``sampler`` and ``scaler`` are anything with ``state_dict()``; their state and
    ``extra`` must be JSON-able (numbers, strings, lists, dicts, tuples, 0-dim tensors). ``step`` is
    the global step to record. ``keep_last=K`` rotates after a successful commit: the new checkpoint
    is verified, checkpoints next to it that fail verification are renamed ``<name>.corrupt``, and
    verified ones of the same ``lineage`` (a run's id, recorded in the manifest; None matches None)
    past the K newest are deleted. ``overwrite`` replaces a same-named checkpoint only if it
    verifies; one that does not is set aside. ``log`` gets a line for each thing set aside or
    deleted. Returns the committed directory.
    """
    engine = get_engine(model)
    faults.armed("ckpt.write")  # a malformed ZEROSHARD_CKPT_FAULT fails here, before any file is written
    mesh = engine.mesh
    final = Path(path)
    partial = final.parent / f".{final.name}.partial"
    problem = None
    side: dict[str, Any] = {}
    if mesh.rank == 0:
        try:
            side = _side_state(scheduler, sampler, scaler, extra)
            problem = _prepare(final, partial, overwrite)
        except CheckpointError as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - reported to every rank instead of hanging them
            problem = f"cannot save checkpoint {final}: {type(e).__name__}: {e}"
    _agree(problem)

    report, problem = None, None
    try:
        report = write_rank_file(partial, model, engine, optimizer, step)
    except Exception as e:  # noqa: BLE001 - reported to every rank instead of hanging them
        problem = f"rank {mesh.rank} could not write its checkpoint file in {partial}: {type(e).__name__}: {e}"
    reports = collectives.all_gather_object((report, problem), phase=PHASE)
    _agree(next((p for _, p in reports if p), None))

    problem = None
    if mesh.rank == 0:
        try:
            manifest = build_manifest(model, engine, optimizer, [r for r, _ in reports], step=step, side=side)
            manifest["lineage"] = lineage
            fmt.write_manifest(partial, manifest)
            rotation = Rotation()
            if overwrite:
                clear_target(final, rotation)
            commit(partial, final, overwrite=overwrite)
            if keep_last:
                rotated = rotate(final.parent, keep_last, newest=final, lineage=lineage)
                rotation.set_aside += rotated.set_aside
                rotation.deleted += rotated.deleted
            for line in rotation.describe():
                log(line)
        except Exception as e:  # noqa: BLE001 - reported to every rank instead of hanging them
            problem = f"rank 0 could not commit checkpoint {final}: {type(e).__name__}: {e}"
    _agree(problem)
    return final


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


def write_rank_file(directory: Path, model: nn.Module, engine: Engine, optimizer, step: int | None) -> dict:
    """Stream this rank's pieces (masters, elementwise optimizer state) and RNG into its file."""
    rank, world = engine.mesh.rank, engine.mesh.world
    segments = SegmentIndex(optimizer) if optimizer is not None else None
    entries: list[Entry] = []
    values: list[torch.Tensor] = []
    pieces: list[list] = []
    scalars: dict[int, dict[str, Any]] = {}

    def add(name: str, tensor: torch.Tensor) -> None:
        entries.append(Entry(name, tensor.dtype, (tensor.numel(),)))
        values.append(tensor)

    for group in engine.groups:
        lo = group.lo
        for slot_index, slot, a, b in owned_slots(group.layout, *writer_range(group, rank, world)):
            fqn = saved_name(group, slot_index)
            if fqn is None:
                continue
            start, stop = a - slot.offset, b - slot.offset
            add(fmt.piece_key("master", fqn, start, stop), group.shard[a - lo:b - lo])
            kinds, index = [], None
            if segments is not None and group.trainable:
                segment = segments.find(group, a, b)
                index = segment.index
                state = optimizer.state.get(segment.param, {})
                tensors, values_0d = split_state(state, segment.stop - segment.start, f"param {slot.fqn!r}")
                rel = a - lo - segment.start
                for name in sorted(tensors):
                    add(fmt.piece_key(f"optim.{name}", fqn, start, stop), tensors[name][rel:rel + b - a])
                    kinds.append(name)
                _merge_scalars(scalars.setdefault(index, {}), values_0d, index)
            pieces.append([fqn, start, stop, kinds, index])
    buffers = []
    if rank == 0:
        for name, buffer in persistent_buffers(model):
            add(fmt.buffer_key(name), buffer)
            buffers.append({"name": name, "shape": list(buffer.shape), "dtype": dtype_name(buffer.dtype)})

    name = fmt.rank_file(rank)
    meta = {fmt.RANK_META_KEY: json.dumps({"rank": rank, "world": world, "rng": rng.capture()})}
    writer = TensorFileWriter(directory / name, entries, meta)
    try:
        for i, (entry, value) in enumerate(zip(entries, values)):
            if i == len(entries) // 2:
                writer.flush()
                faults.point("ckpt.write", rank=rank, step=step)  # ZEROSHARD_CKPT_FAULT: die mid-write
            writer.write(entry.name, value)
        digest, size = writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"rank": rank, "file": name, "sha256": digest, "bytes": size, "pieces": pieces,
            "scalars": {str(k): v for k, v in scalars.items()}, "buffers": buffers}


def _merge_scalars(into: dict[str, Any], new: dict[str, Any], index: int) -> None:
    for name, value in new.items():
        encoded = fmt.to_json(value, f"optimizer state {name!r}")
        if name in into and into[name] != encoded:
            raise CheckpointError(
                f"optimizer scalar state {name!r} differs between params of param group {index} "
                f"({into[name]} vs {encoded}); a checkpoint stores one value per param group")
        into[name] = encoded


def build_manifest(model: nn.Module, engine: Engine, optimizer, reports: list[dict], *, step: int | None,
                   side: dict[str, Any]) -> dict:
    """Rank 0 merges every rank's report into the manifest (checking that the pieces tile each param)."""
    import zeroshard

    pieces: dict[str, list[dict]] = {}
    kinds: dict[str, set] = {}
    index_of: dict[str, int | None] = {}
    for report in reports:
        for fqn, start, stop, state, index in report["pieces"]:
            pieces.setdefault(fqn, []).append({"file": report["file"], "start": start, "stop": stop})
            kinds.setdefault(fqn, set()).add(tuple(state))
            index_of[fqn] = index
    params = []
    for group, i in ordered_refs(model, engine.groups):
        slot, ref, spec = group.layout.slots[i], group.refs[i], group.tp_specs[i]
        # A tensor-parallel param: one entry per tp rank's part, each recording the placement.
        parts: list[tuple[str, list[str], dict | None]] = \
            [(slot.fqn, list(ref.aliases), None)] if spec is None or spec.shard_dim is None else \
            [(f"{slot.fqn}{TP_PART}{r}", [], dict(spec.describe(), of=slot.fqn, rank=r, aliases=list(ref.aliases),
                                                  full_shape=list(spec.shape))) for r in range(spec.mesh.size())]
        for fqn, aliases, placement in parts:
            states = kinds.get(fqn, {()})
            if len(states) != 1:
                raise CheckpointError(f"ranks saved different optimizer state for param {fqn!r}: {sorted(states)}")
            params.append({
                "fqn": fqn, "aliases": aliases, "shape": list(slot.shape),
                "dtype": dtype_name(group.master_dtype), "trainable": group.trainable,
                "param_group": index_of.get(fqn), "state": list(next(iter(states))),
                "pieces": sorted(pieces.get(fqn, []), key=lambda p: p["start"]),
                **({"tp": placement} if placement is not None else {}),
            })
    manifest = {
        "format": fmt.FORMAT, "version": fmt.VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "zeroshard": zeroshard.__version__, "torch": torch.__version__, "git": fmt.git_revision(),
        "step": step, "world": engine.mesh.world, "mesh": engine.mesh.describe(),
        "stage": engine.policy.stage, "units": [u.name for u in engine.units],
        "precision": _precision(model, optimizer),
        "model": _model_info(model),
        "params": params,
        "buffers": [dict(b, file=reports[0]["file"], key=fmt.buffer_key(b["name"])) for b in reports[0]["buffers"]],
        "groups": [{"unit": g.unit, "trainable": g.trainable, "master_dtype": dtype_name(g.master_dtype),
                    "compute_dtype": dtype_name(g.compute_dtype), "params": [s.fqn for s in g.layout.slots]}
                   for g in engine.groups],
        "optimizer": _optimizer_info(optimizer, reports),
        **side,
        "ranks": [{"rank": r["rank"], "file": r["file"]} for r in reports],
        "files": {r["file"]: {"sha256": r["sha256"], "bytes": r["bytes"]} for r in reports},
    }
    fmt.check_coverage(manifest, Path("<being saved>"))
    return manifest


def _precision(model: nn.Module, optimizer) -> dict | None:
    from zeroshard import sharding

    describe = getattr(sharding, "precision_manifest", None)
    return None if describe is None else fmt.to_json(describe(model, optimizer), "precision manifest")


def _model_info(model: nn.Module) -> dict:
    cfg = getattr(model, "cfg", None)
    config = cfg.to_dict() if cfg is not None and hasattr(cfg, "to_dict") else None
    return {"class": f"{type(model).__module__}.{type(model).__qualname__}",
            "config": fmt.to_json(config, "model.cfg.to_dict()")}


def _optimizer_info(optimizer, reports: list[dict]) -> dict | None:
    if optimizer is None:
        return None
    scalars: dict[int, dict[str, Any]] = {}
    for report in reports:
        for key, values in report["scalars"].items():
            _merge_scalars_json(scalars.setdefault(int(key), {}), values, int(key))
    base = user_class(optimizer)
    return {
        "class": f"{base.__module__}.{base.__qualname__}",
        "param_groups": [{"options": fmt.to_json({k: v for k, v in g.items() if k != "params"}, f"param group {i}"),
                          "scalars": scalars.get(i, {})} for i, g in enumerate(optimizer.param_groups)],
    }


def _merge_scalars_json(into: dict, new: dict, index: int) -> None:
    for name, value in new.items():
        if name in into and into[name] != value:
            raise CheckpointError(f"optimizer scalar state {name!r} of param group {index} differs between ranks "
                                  f"({into[name]} vs {value})")
        into[name] = value


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
