"""Offline tools with no process group: a streamed full export, and resharding to M rank files.

Both read the checkpoint piece by piece and write through the streaming safetensors writer, so
memory stays at about one param (export) or one piece (reshard), never the model. DeepSpeed's
consolidation gathers everything first (an 80B model needed over 1 TB of host memory, PEERS.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.load import PieceReader, saved_rng
from zeroshard.checkpoint.pieces import owned_slots
from zeroshard.checkpoint.save import commit
from zeroshard.checkpoint.tensorfile import Entry, TensorFileWriter, parse_dtype
from zeroshard.checkpoint.verify import resolve, verify
from zeroshard.sharding.layout import FlatLayout


@dataclasses.dataclass
class ExportStats:
    path: Path
    tensors: int
    bytes: int
    largest_param_bytes: int
    """The most any one param needs in memory; the export's working set is two of these."""


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def export(src: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | None = None,
           overwrite: bool = False) -> ExportStats:
    """Write every param (under each of its names, as ``state_dict()`` has them) and buffer of a
    checkpoint to one safetensors file, one param at a time, so that
    ``model.load_state_dict(safetensors.torch.load_file(out))`` works on the plain model."""
    directory = resolve(src)
    manifest = verify(directory)
    out = Path(out)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; choose another output path or pass overwrite=True")
    entries, largest = [], 0
    params = full_params(manifest)
    for param in params:
        saved = parse_dtype(param["dtype"], str(directory))
        largest = max(largest, _numel(param["shape"]) * saved.itemsize)
        for alias in param["aliases"]:
            entries.append(Entry(alias, dtype or saved, tuple(param["shape"])))
    for buffer in manifest["buffers"]:
        entries.append(Entry(buffer["name"], parse_dtype(buffer["dtype"], str(directory)), tuple(buffer["shape"])))
    tmp = out.with_name(f".{out.name}.partial")
    meta = {"format": "pt", "zeroshard.source": str(directory), "zeroshard.step": json.dumps(manifest["step"])}
    writer = TensorFileWriter(tmp, entries, meta)
    reader = PieceReader(directory, manifest)
    # Two scratch buffers of the largest param's size, used in turn: the writer may still be
    # hashing the previous param while the next is read, and reusing the same two buffers keeps
    # the working set at exactly two params (fresh allocations would let the heap grow instead).
    scratch = [torch.empty(largest, dtype=torch.uint8) for _ in range(2)]
    try:
        for turn, param in enumerate(params):
            saved = parse_dtype(param["dtype"], str(directory))
            value = scratch[turn % 2][:_numel(param["shape"]) * saved.itemsize].view(saved)
            reader.fill(param, "master", 0, value)
            if dtype is not None and dtype != saved:
                value = value.to(dtype)
            for alias in param["aliases"]:
                writer.write(alias, value)
        for buffer in manifest["buffers"]:
            writer.write(buffer["name"], reader.file(buffer["file"]).read(buffer["key"]))
        _, size = writer.close()
    except BaseException:
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        reader.close()
    os.replace(tmp, out)
    fmt.fsync_dir(out.parent)
    return ExportStats(out, len(entries), size, largest)


def full_params(manifest: dict) -> list[dict]:
    """The manifest's params as whole tensors: a tensor-parallel param's parts (one per tp rank)
    become one view that ``PieceReader.fill`` joins into the full tensor."""
    out, seen = [], set()
    for param in manifest["params"]:
        placement = param.get("tp")
        if placement is None:
            out.append(param)
        elif placement["of"] not in seen:
            seen.add(placement["of"])
            parts = sorted((p for p in manifest["params"] if p.get("tp", {}).get("of") == placement["of"]),
                           key=lambda p: p["tp"]["rank"])
            out.append({"view": True, "fqn": placement["of"], "aliases": placement["aliases"],
                        "shape": placement["full_shape"], "dtype": param["dtype"], "state": param["state"],
                        "sources": parts, "target": None, "tp_rank": 0})
    return out


def reshard(src: str | os.PathLike, dst: str | os.PathLike, world: int, *, overwrite: bool = False) -> Path:
    """Rewrite a checkpoint as ``world`` rank files, each holding the 1/world shard of every flat group
    that a stage-1..3 run on ``world`` ranks owns. Any checkpoint loads at any world size anyway;
    this makes each rank of the new world read exactly one file. A tensor-parallel checkpoint
    becomes this data-parallel layout (its parts joined into whole params)."""
    if world < 1:
        raise CheckpointError(f"world must be >= 1, got {world}")
    directory = resolve(src)
    manifest = verify(directory)
    # A tensor-parallel checkpoint's parts are joined into whole params: the result is the
    # data-parallel (world, tp=1) layout, which zs.load then reads at any (dp, tp) layout.
    whole = {p["fqn"]: p for p in full_params(manifest)}
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} already exists; choose another destination or pass overwrite=True")
    partial = dst.parent / f".{dst.name}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    reader = PieceReader(directory, manifest)
    params = whole
    pieces: dict[str, list[dict]] = {fqn: [] for fqn in params}
    files: dict[str, dict] = {}
    try:
        for rank in range(world):
            name = fmt.rank_file(rank)
            jobs: list[tuple[Entry, dict, str, int]] = []
            for group in manifest["groups"]:
                layout = FlatLayout([(f, torch.Size(params[f]["shape"])) for f in group["params"]], world)
                for _, slot, a, b in owned_slots(layout, *layout.shard_range(rank)):
                    param, start, stop = params[slot.fqn], a - slot.offset, b - slot.offset
                    pieces[slot.fqn].append({"file": name, "start": start, "stop": stop})
                    for kind in ["master"] + [f"optim.{s}" for s in param["state"]]:
                        jobs.append((Entry(fmt.piece_key(kind, slot.fqn, start, stop),
                                           _stored_dtype(reader, param, kind, start), (stop - start,)),
                                     param, kind, start))
            buffers = manifest["buffers"] if rank == 0 else []
            meta = {fmt.RANK_META_KEY: json.dumps({"rank": rank, "world": world, "rng": saved_rng(reader, rank)})}
            entries = [job[0] for job in jobs] + [
                Entry(b["key"], parse_dtype(b["dtype"], str(directory)), tuple(b["shape"])) for b in buffers]
            writer = TensorFileWriter(partial / name, entries, meta)
            for entry, param, kind, start in jobs:
                value = torch.empty(entry.numel, dtype=entry.dtype)
                reader.fill(param, kind, start, value)
                writer.write(entry.name, value)
            for b in buffers:
                writer.write(b["key"], reader.file(b["file"]).read(b["key"]))
            digest, size = writer.close()
            files[name] = {"sha256": digest, "bytes": size}
    finally:
        reader.close()
    new = dict(manifest)
    new.pop("manifest_sha256", None)
    new.update(
        world=world, mesh={"world": world, "shard_size": world, "replicate_size": 1, "resharded_offline": True},
        params=[dict(_plain(p), pieces=pieces[p["fqn"]]) for p in params.values()],
        buffers=[dict(b, file=fmt.rank_file(0)) for b in manifest["buffers"]],
        ranks=[{"rank": r, "file": fmt.rank_file(r)} for r in range(world)], files=files,
        resharded_from={"path": str(directory), "world": manifest["world"]},
    )
    fmt.check_coverage(new, partial)
    fmt.write_manifest(partial, new)
    commit(partial, dst, overwrite=overwrite, latest=False)
    return dst


def _plain(param: dict) -> dict:
    """A manifest entry for a whole param (a joined tensor-parallel view loses its parts)."""
    if "view" not in param:
        return param
    first = param["sources"][0]
    return {"fqn": param["fqn"], "aliases": param["aliases"], "shape": param["shape"], "dtype": param["dtype"],
            "trainable": first["trainable"], "param_group": first["param_group"], "state": param["state"]}


def _stored_dtype(reader: PieceReader, param: dict, kind: str, start: int) -> torch.dtype:
    if "view" in param:
        param, start = param["sources"][0], 0
    piece = reader.pieces(param, start, start + 1)[0]
    key = fmt.piece_key(kind, param["fqn"], piece["start"], piece["stop"])
    return reader.file(piece["file"]).stored(key).dtype


__all__ = ["ExportStats", "export", "reshard"]
