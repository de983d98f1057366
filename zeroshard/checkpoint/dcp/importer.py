"""``zeroshard ckpt import-dcp``: a DCP directory -> a zeroshard checkpoint, streamed and atomic.

What moves: every model tensor (params, and the persistent buffers named by ``buffers``), the
elementwise optimizer state of each param (AdamW's ``exp_avg``/``exp_avg_sq``) and its scalar state
(``step``, which must be equal for all params, as it is after any run of steps). What does not:
optimizer param-group options (lr, betas, weight decay: DCP stores them pickled, and the optimizer
you build with ``zs.optimizer`` brings its own), LR scheduler, data loader and anything else.

A tied weight appears under each of its names in an FSDP2 state dict, but its optimizer state under
one. A model tensor with no optimizer state of its own that is bitwise equal to an earlier one of
the same shape is recorded as an alias of it, which is what ``zs.load`` expects of tied weights;
aliasing two equal untied tensors is harmless, since both load the same values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint import rng
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.save import commit
from zeroshard.checkpoint.staging import refuse_existing
from zeroshard.checkpoint.tensorfile import Entry, TensorFileWriter, dtype_name
from zeroshard.checkpoint.dcp import stream
from zeroshard.checkpoint.dcp.layout import DCPLayout, Tensor, read_layout

FILE = fmt.rank_file(0)


@dataclasses.dataclass
class ImportedDCP:
    path: Path
    params: list[str]
    buffers: list[str]
    tied: dict[str, str]
    """Alias -> the param it is tied to."""
    optimizer_state: list[str]
    step: int | None
    ignored: list[str]
    bytes: int


def optimizer_class_name(name: str) -> str:
    """``torch.optim.AdamW`` -> ``torch.optim.adamw.AdamW``, the spelling zs.load compares."""
    module, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr) if module else None
    except ImportError:
        cls = None
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise CheckpointError(f"--optimizer {name!r} is not an importable torch.optim.Optimizer class; "
                              "give its dotted name, e.g. torch.optim.AdamW")
    return f"{cls.__module__}.{cls.__qualname__}"


def _seeded_rng() -> dict[str, Any]:
    """RNG state for the imported run: that of seed 0 (DCP holds none), captured without disturbing ours."""
    saved = rng.capture()
    try:
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        return rng.capture()
    finally:
        rng.restore(saved)


def _tied(layout: DCPLayout, params: list[str], budget: int) -> dict[str, str]:
    """Alias -> owner for stateless model tensors bitwise equal to an earlier same-shaped one."""
    stateful = set(layout.state) | set(layout.scalars)
    kinds: dict[tuple, list[str]] = {}
    for fqn in params:
        t = layout.model[fqn]
        kinds.setdefault((t.shape, t.dtype), []).append(fqn)
    wanted = []
    for fqns in kinds.values():
        if any(f not in stateful for f in fqns[1:]):
            wanted += fqns
    digests: dict[str, str] = {}
    by_key = {layout.model[f].key: f for f in wanted}
    for t, value in stream.read(layout.path, [layout.model[f] for f in wanted], budget=budget):
        raw = memoryview(value.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer
        digests[by_key[t.key]] = hashlib.sha256(raw).hexdigest()
    tied: dict[str, str] = {}
    for fqns in kinds.values():
        for i, alias in enumerate(fqns):
            if alias in stateful or alias not in digests:
                continue
            owner = next((f for f in fqns[:i] if f not in tied and digests.get(f) == digests[alias]), None)
            if owner is not None:
                tied[alias] = owner
    return tied


def _scalars(layout: DCPLayout, params: list[str]) -> dict[str, torch.Tensor]:
    """The optimizer's scalar state, one value per name for every param (zeroshard keeps it per group)."""
    wanted = [t for f in params for t in layout.scalars.get(f, {}).values()]
    values = {t.key: v for t, v in stream.read(layout.path, wanted)}
    out: dict[str, torch.Tensor] = {}
    first: dict[str, str] = {}
    for fqn in params:
        for name, t in layout.scalars.get(fqn, {}).items():
            if name in out and not torch.equal(out[name], values[t.key]):
                raise CheckpointError(f"{layout.path}: optimizer state {name!r} is {out[name].item()} for "
                                      f"{first[name]!r} but {values[t.key].item()} for {fqn!r}; zeroshard keeps one "
                                      "value per param group, so it cannot import this run")
            out.setdefault(name, values[t.key])
            first.setdefault(name, fqn)
    return out


def _plan(layout: DCPLayout, params: list[str], buffers: list[str], dtype: torch.dtype | None):
    """(entries, what to read for each): masters and optimizer state of each param, then buffers."""
    entries: list[Entry] = []
    reads: list[Tensor] = []

    def cast(t: Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.dtype.is_floating_point else t.dtype

    for fqn in params:
        t = layout.model[fqn]
        if t.numel == 0:
            continue
        entries.append(Entry(fmt.piece_key("master", fqn, 0, t.numel), cast(t), (t.numel,)))
        reads.append(t)
        for name in sorted(layout.state.get(fqn, {})):
            s = layout.state[fqn][name]
            entries.append(Entry(fmt.piece_key(f"optim.{name}", fqn, 0, t.numel), cast(s), (t.numel,)))
            reads.append(s)
    for name in buffers:
        t = layout.model[name]
        entries.append(Entry(fmt.buffer_key(name), t.dtype, t.shape))
        reads.append(t)
    return entries, reads


def _manifest(layout: DCPLayout, params: list[str], buffers: list[str], tied: dict[str, str],
              scalars: dict[str, torch.Tensor], entries: list[Entry], optimizer: str | None,
              param_groups: int, file: tuple[str, int]) -> dict:
    from zeroshard import __version__

    dtypes = {e.name: e.dtype for e in entries}
    aliases: dict[str, list[str]] = {fqn: [fqn] for fqn in params}
    for alias, owner in tied.items():
        aliases[owner].append(alias)
    records: list[dict] = []
    groups: dict[str, list[str]] = {}
    for fqn in params:
        t = layout.model[fqn]
        key = fmt.piece_key("master", fqn, 0, t.numel)
        dtype = dtype_name(dtypes.get(key, t.dtype))
        records.append({"fqn": fqn, "aliases": aliases[fqn], "shape": list(t.shape), "dtype": dtype,
                        "trainable": True, "param_group": None, "state": sorted(layout.state.get(fqn, {})),
                        "pieces": [{"file": FILE, "start": 0, "stop": t.numel}] if t.numel else []})
        groups.setdefault(dtype, []).append(fqn)
    step = scalars.get("step")
    moved = optimizer is not None and bool(layout.state or scalars)
    return {
        "format": fmt.FORMAT, "version": fmt.VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "zeroshard": __version__, "torch": torch.__version__, "git": fmt.git_revision(),
        "step": None if step is None else int(step.item()), "world": 1,
        "mesh": {"world": 1, "shard_size": 1, "replicate_size": 1},
        "stage": 0, "units": ["dcp"], "precision": None,
        "model": {"class": "torch.distributed.checkpoint", "config": None},
        "params": records,
        "buffers": [{"name": b, "shape": list(layout.model[b].shape), "dtype": dtype_name(layout.model[b].dtype),
                     "file": FILE, "key": fmt.buffer_key(b)} for b in buffers],
        "groups": [{"unit": "dcp", "trainable": True, "master_dtype": d, "compute_dtype": d, "params": fqns}
                   for d, fqns in groups.items()],
        "optimizer": None if not moved else {
            "class": optimizer,
            "param_groups": [{"options": {}, "scalars": {n: fmt.to_json(v, f"optimizer state {n!r}")
                                                         for n, v in scalars.items()}}
                             for _ in range(param_groups)]},
        "scheduler": None, "sampler": None, "scaler": None, "extra": None,
        "imported_from": {"format": "torch.distributed.checkpoint", "path": str(layout.path.resolve())},
        "ranks": [{"rank": 0, "file": FILE}],
        "files": {FILE: {"sha256": file[0], "bytes": file[1]}},
    }


def import_dcp(src: str | os.PathLike, out: str | os.PathLike, *, buffers: tuple[str, ...] = (),
               optimizer: str | None = "torch.optim.AdamW", param_groups: int = 2,
               dtype: torch.dtype | None = None, overwrite: bool = False,
               batch_bytes: int = stream.BATCH_BYTES) -> ImportedDCP:
    """Write the zeroshard checkpoint ``out`` from the DCP directory ``src`` (offline, one process).

    ``buffers``: globs of model tensors that are buffers, not params (DCP does not tell them apart).
    ``optimizer``: the torch class the state belongs to (DCP does not record it), None to leave the
    optimizer state behind. ``param_groups``: how many groups the zeroshard optimizer will have
    (zs.optimizer's default is two, decay and no-decay); each gets the same scalar state.
    ``dtype`` casts floating params and state (e.g. bf16 FSDP2 params into fp32 masters).
    Memory: one read batch (``batch_bytes``, or the largest tensor) plus the file writer's buffer.
    """
    out = Path(out)
    refuse_existing(out, overwrite)
    if param_groups < 1:
        raise CheckpointError(f"param_groups must be >= 1, got {param_groups}")
    opt_class = optimizer_class_name(optimizer) if optimizer is not None else None
    layout, buffer_set = read_layout(src, buffers=buffers)
    stateful = sorted(b for b in buffer_set if b in layout.state or b in layout.scalars)
    if stateful:
        raise CheckpointError(f"--buffers matched {stateful[0]!r}, which has optimizer state, so it is a param; "
                              "narrow the glob")
    if opt_class is None:
        layout.state, layout.scalars = {}, {}
    candidates = [f for f in layout.model if f not in buffer_set]
    tied = _tied(layout, candidates, batch_bytes)
    params = [f for f in candidates if f not in tied]
    names = [f for f in layout.model if f in buffer_set]
    scalars = _scalars(layout, params)
    entries, reads = _plan(layout, params, names, dtype)
    partial = out.parent / f".{out.name}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        writer = TensorFileWriter(partial / FILE, entries,
                                  {fmt.RANK_META_KEY: json.dumps({"rank": 0, "world": 1, "rng": _seeded_rng()})})
        try:
            for entry, (_, value) in zip(entries, stream.read(layout.path, reads, budget=batch_bytes)):
                writer.write(entry.name, value.to(entry.dtype))
            file = writer.close()
        except BaseException:
            writer.abort()
            raise
        manifest = _manifest(layout, params, names, tied, scalars, entries, opt_class, param_groups, file)
        fmt.check_coverage(manifest, partial)
        fmt.write_manifest(partial, manifest)
        commit(partial, out, overwrite=overwrite, latest=False)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    moved = sorted({n for f in params for n in layout.state.get(f, {})} | set(scalars))
    return ImportedDCP(out, params, names, tied, moved, manifest["step"], sorted(layout.ignored), file[1])
