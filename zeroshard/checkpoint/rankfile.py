"""One rank's file of a checkpoint: which tensors it holds, and writing them with salvage data.

``collect`` lists this rank's pieces (masters, elementwise optimizer state, and on rank 0 the
persistent buffers) as views of the live tensors, plus the rank's *report* (zeroshard/checkpoint/
manifest.py). ``write`` streams them into ``rank-NNNNN.safetensors``, whose header metadata carries,
besides the rank's RNG states:

- the report (every piece's param, element range, state kinds, optimizer param group; scalars;
  buffers), and on rank 0 the manifest skeleton (names, shapes, dtypes, placements of every param);
- the sha256 of every tensor's bytes, so that the file can be checked on its own.

That is what ``zeroshard ckpt repair`` needs to rebuild a lost manifest. The per-tensor digests
must be in the header, which is written before the data, so they are computed in a pass over the
tensors before the write (the file's own sha256 is still computed while writing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard.comm import fault_points as faults
from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.manifest import CHECKSUMS_KEY, REPORT_KEY, SKELETON_KEY
from zeroshard.checkpoint.stages import Parts
from zeroshard.checkpoint.pieces import (SegmentIndex, owned_slots, persistent_buffers, saved_extent, saved_name,
                                         split_state, writer_range)
from zeroshard.checkpoint import owner_state
from zeroshard.runtime.owners import held_range
from zeroshard.checkpoint.tensorfile import Entry, TensorFileWriter, as_bytes, dtype_name
from zeroshard.runtime.engine import Engine


@dataclasses.dataclass
class RankPieces:
    """What one rank writes: the tensors in file order, and its report."""

    rank: int
    world: int
    entries: list[Entry]
    values: list[torch.Tensor]
    report: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def collect(model: nn.Module, engine: Engine, optimizer, *, skip: frozenset[str] = frozenset(),
            write_buffers: bool | None = None, buffers_done: frozenset[str] = frozenset()) -> RankPieces:
    """This rank's pieces, as views of the live shards (nothing is copied). ``skip``: params another
    part saves (a tied copy); ``write_buffers``: whether this rank writes ``model``'s persistent
    buffers (default: rank 0, which holds every buffer without a pipeline), except ``buffers_done``."""
    rank, world = engine.mesh.rank, engine.mesh.world
    segments = SegmentIndex(optimizer) if optimizer is not None else None
    owned = owner_state.spread(optimizer, engine)  # collective: owners' state cut into this rank's pieces
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
            if fqn is None or slot.fqn in skip:
                continue
            start = a - slot.offset + saved_extent(group, slot_index)[1]
            stop = start + b - a
            add(fmt.piece_key("master", fqn, start, stop), group.shard[a - lo:b - lo])
            kinds, index = [], None
            whole = owned.lookup(group, slot_index) if owned is not None else None
            if whole is not None:  # stepped whole on an owner: its state arrived in pieces like this one's
                item, names, tensors = whole
                index, rel = item.torch_group, a - slot.offset - held_range(item)[0]
                for name, tensor in zip(names, tensors):
                    add(fmt.piece_key(f"optim.{name}", fqn, start, stop), tensor[rel:rel + b - a])
                    kinds.append(name)
            elif segments is not None and group.trainable:
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
    for index, values_0d in (owned.scalars.items() if owned is not None else ()):
        _merge_scalars(scalars.setdefault(index, {}), values_0d, index)
    buffers = []
    if rank == 0 if write_buffers is None else write_buffers:
        for name, buffer in persistent_buffers(model):
            if name in buffers_done:
                continue  # a param-free module every stage keeps: its buffers are written once
            add(fmt.buffer_key(name), buffer)
            buffers.append({"name": name, "shape": list(buffer.shape), "dtype": dtype_name(buffer.dtype)})
    report = {"rank": rank, "file": fmt.rank_file(rank), "pieces": pieces,
              "scalars": {str(k): v for k, v in scalars.items()}, "buffers": buffers}
    return RankPieces(rank, world, entries, values, report)


def collect_parts(parts: Parts) -> RankPieces:
    """This rank's pieces of every part (one per pipeline stage it runs) as one file's worth. The
    optimizer scalars of param group i are every stage's group i: the stages step together, so
    they agree (a mismatch is an error, as between two params of one group)."""
    if parts.pipeline is None:
        part = parts.first
        return collect(part.module, part.engine, part.optimizer)
    mesh = parts.engine.mesh
    first_of_stage = mesh.dp_rank == 0 and mesh.tp_rank == 0  # a stage's buffers: written once, here
    merged: RankPieces | None = None
    for p in parts.parts:
        done = frozenset(b["name"] for b in merged.report["buffers"]) if merged is not None else frozenset()
        more = collect(p.module, p.engine, p.optimizer, skip=p.skip, write_buffers=first_of_stage, buffers_done=done)
        if merged is None:
            merged = more
            continue
        merged.entries += more.entries
        merged.values += more.values
        merged.report["pieces"] += more.report["pieces"]
        merged.report["buffers"] += more.report["buffers"]
        for index, values in more.report["scalars"].items():
            into = merged.report["scalars"].setdefault(index, {})
            for name, value in values.items():
                if name in into and into[name] != value:
                    raise CheckpointError(f"optimizer scalar state {name!r} of param group {index} differs between "
                                          f"pipeline stages ({into[name]} vs {value}); the stages must step together")
                into[name] = value
    assert merged is not None  # a pipeline rank runs at least one stage
    return merged


def _merge_scalars(into: dict[str, Any], new: dict[str, Any], index: int) -> None:
    for name, value in new.items():
        encoded = fmt.to_json(value, f"optimizer state {name!r}")
        if name in into and into[name] != encoded:
            raise CheckpointError(
                f"optimizer scalar state {name!r} differs between params of param group {index} "
                f"({into[name]} vs {encoded}); a checkpoint stores one value per param group")
        into[name] = encoded


def tensor_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(as_bytes(tensor)).hexdigest()


def write(directory: Path, pieces: RankPieces, *, rng_state: dict, step: int | None,
          skeleton: dict | None = None) -> dict:
    """Write ``pieces`` to this rank's file in ``directory``; returns the report with the file's
    ``sha256`` and ``bytes``. ``rng_state`` is this rank's RNG (captured when the state was)."""
    meta = {
        fmt.RANK_META_KEY: json.dumps({"rank": pieces.rank, "world": pieces.world, "rng": rng_state}),
        REPORT_KEY: json.dumps(pieces.report),
        CHECKSUMS_KEY: json.dumps({e.name: tensor_sha256(v) for e, v in zip(pieces.entries, pieces.values)}),
    }
    if skeleton is not None:
        meta[SKELETON_KEY] = json.dumps(skeleton)
    writer = TensorFileWriter(directory / pieces.report["file"], pieces.entries, meta)
    try:
        for i, (entry, value) in enumerate(zip(pieces.entries, pieces.values)):
            if i == len(pieces.entries) // 2:
                writer.flush()
                faults.point("ckpt.write", rank=pieces.rank, step=step)  # ZEROSHARD_CKPT_FAULT: die mid-write
            writer.write(entry.name, value)
        digest, size = writer.close()
    except BaseException:
        writer.abort()
        raise
    return dict(pieces.report, sha256=digest, bytes=size)
