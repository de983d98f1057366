"""Offline tools with no process group: a streamed full export, and resharding to M rank files.

Both read the checkpoint piece by piece and write through the streaming safetensors writer, so
memory stays at about one param (export) or one piece (reshard), never the model. DeepSpeed's
consolidation gathers everything first (an 80B model needed over 1 TB of host memory, PEERS.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.load import PieceReader, saved_rng
from zeroshard.checkpoint.pieces import TP_PART, owned_slots
from zeroshard.checkpoint.save import commit
from zeroshard.checkpoint.staging import fresh_partial, partial_of, refuse_existing
from zeroshard.checkpoint.tensorfile import Entry, TensorFileWriter, parse_dtype
from zeroshard.checkpoint.verify import resolve, verify
from zeroshard.runtime.expert_placement import split_over
from zeroshard.runtime.tp_plan import placement_of
from zeroshard.models.specs import NAMED_TP_PLANS, named_tp_plan
from zeroshard.runtime.layout import FlatLayout, decay_first
from zeroshard.runtime.wrap import BUCKET_JOIN, ROOT


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
    refuse_existing(out, overwrite, how="overwrite=True")
    entries, largest = [], 0
    params = full_params(manifest)
    for param in params:
        saved = parse_dtype(param["dtype"], str(directory))
        largest = max(largest, _numel(param["shape"]) * saved.itemsize)
        for alias in param["aliases"]:
            entries.append(Entry(alias, dtype or saved, tuple(param["shape"])))
    for buffer in manifest["buffers"]:
        entries.append(Entry(buffer["name"], parse_dtype(buffer["dtype"], str(directory)), tuple(buffer["shape"])))
    tmp = partial_of(out)
    meta = {"format": "pt", "zeroshard.source": str(directory), "zeroshard.trainer.step": json.dumps(manifest["step"])}
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


def reshard(src: str | os.PathLike, dst: str | os.PathLike, world: int, *, tp: int = 1, tp_plan: str | None = None,
            ep: int = 1, overwrite: bool = False) -> Path:
    """Rewrite a checkpoint as ``world`` rank files laid out as (world / tp data-parallel, tp): each
    rank file holds the 1/dp shard of every flat group that a stage-1..3 run with that rank's tp
    index owns. Any checkpoint loads at any layout anyway; this makes each rank of a run with the
    saved flat groups (the same stage and bucketing) read its own file, plus tp rank 0's for the
    params every tp rank holds whole (written once, as a save writes them).

    A tp-sharded param keeps its saved dim and chunks at the new degree; a checkpoint saved without
    TP has no placements, so going to tp > 1 takes them from ready plan ``tp_plan`` ("gpt", "llama").
    The values go through the reader ``zs.load`` uses (saved parts joined, this rank's part cut).

    ``ep`` lays the expert params (those the manifest places on ep, zeroshard/runtime/expert_placement.py)
    out as a run at that expert-parallel degree holds them: rank r keeps the block of experts of
    ep rank r % ep, sharded over the world / ep ranks with it; ep 1 puts them with the dense ones.
    An expert param is stored whole at every degree (each block a run of its elements), so only
    which rank file holds which run changes, moments included."""
    if world < 1 or tp < 1 or world % tp:
        raise CheckpointError(f"world {world} with tp {tp}: both must be >= 1 and tp must divide world "
                              "(world = data-parallel ranks x tp)")
    directory = resolve(src)
    manifest = verify(directory)
    whole = {p["fqn"]: p for p in full_params(manifest)}
    _check_ep(whole, world, tp, ep, directory)
    groups = _groups_at(manifest, whole, ep)
    saved_tp = any("tp" in p for p in manifest["params"])
    targets = {fqn: _target(p, tp, tp_plan, saved_tp, directory) for fqn, p in whole.items()}
    dst = Path(dst)
    refuse_existing(dst, overwrite, choose="destination", how="overwrite=True")
    partial = fresh_partial(dst)
    reader = PieceReader(directory, manifest)
    pieces: dict[str, list[dict]] = {}
    files: dict[str, dict] = {}
    try:
        for rank in range(world):
            name = fmt.rank_file(rank)
            jobs = _rank_jobs(groups, whole, targets, reader, rank, world // tp, tp, ep, name, pieces)
            buffers = manifest["buffers"] if rank == 0 else []
            meta = {fmt.RANK_META_KEY: json.dumps({"rank": rank, "world": world, "rng": saved_rng(reader, rank)})}
            entries = [job[0] for job in jobs] + [
                Entry(b["key"], parse_dtype(b["dtype"], str(directory)), tuple(b["shape"])) for b in buffers]
            writer = TensorFileWriter(partial / name, entries, meta)
            for entry, view, kind, start in jobs:
                value = torch.empty(entry.numel, dtype=entry.dtype)
                reader.fill(view, kind, start, value)
                writer.write(entry.name, value)
            for b in buffers:
                writer.write(b["key"], reader.file(b["file"]).read(b["key"]))
            digest, size = writer.close()
            files[name] = {"sha256": digest, "bytes": size}
    finally:
        reader.close()
    params = [entry for fqn, p in whole.items() for entry in _entries(p, targets[fqn], tp, pieces, world, ep)]
    new = _resharded_manifest(manifest, directory, world=world, tp=tp, ep=ep, params=params, groups=groups,
                              files=files)
    fmt.check_coverage(new, partial)
    fmt.write_manifest(partial, new)
    commit(partial, dst, overwrite=overwrite, latest=False)
    return dst


def _resharded_manifest(manifest: dict, directory: Path, *, world: int, tp: int, ep: int, params: list[dict],
                        groups: list, files: dict[str, dict]) -> dict:
    """The saved manifest laid out for ``world`` (dp, tp) ranks at ``ep``, naming where it came from."""
    new = dict(manifest)
    new.pop("manifest_sha256", None)
    new.pop("pipeline", None)  # the rank files are laid out for (dp, tp) ranks that each run every stage
    new.update(
        world=world, mesh={"world": world, "shard_size": world // tp, "replicate_size": 1, "tp_size": tp,
                           **({"ep_size": ep} if ep > 1 else {}), "resharded_offline": True},
        params=params, groups=groups, buffers=[dict(b, file=fmt.rank_file(0)) for b in manifest["buffers"]],
        ranks=[{"rank": r, "file": fmt.rank_file(r)} for r in range(world)], files=files,
        resharded_from={"path": str(directory), "world": manifest["world"],
                        "tp": manifest["mesh"].get("tp_size", 1), "ep": manifest["mesh"].get("ep_size", 1),
                        "pp": manifest["mesh"].get("pp_size", 1)},
    )
    return new


def _check_ep(whole: dict[str, dict], world: int, tp: int, ep: int, directory: Path) -> None:
    """An ep the checkpoint's experts and the new world can take, or one line naming the fix."""
    if ep == 1:
        return
    experts = [p for p in whole.values() if "ep" in p]
    if ep < 1 or world % ep:
        raise CheckpointError(f"ep {ep} does not divide world {world}; pick an ep that divides it "
                              "(world = ep x the ranks that shard each block of experts)")
    if tp > 1:
        raise CheckpointError(f"ep {ep} with tp {tp}: ckpt reshard does not lay experts out over tp ranks yet; "
                              "reshard with --tp 1 (zs.load and --resume read the checkpoint at any ep x tp as it is)")
    if not experts:
        raise CheckpointError(f"{directory} was saved without expert parallelism, so it records no expert placement; "
                              "reshard it with --ep 1 (zs.load reads it at any ep as it is: each rank its block)")
    for param in experts:
        if param["shape"][0] % ep:
            raise CheckpointError(f"ep {ep} does not divide the {param['shape'][0]} experts of {param['fqn']!r}; "
                                  "pick an ep that divides them")


def _groups_at(manifest: dict, whole: dict[str, dict], ep: int) -> list[dict]:
    """The flat groups a run at ``ep`` has: the saved ones, except that at ep 1 each expert group
    joins its unit's dense group of the same dtypes and grad policy, as the engine groups params
    when there is no expert mesh (``split_groups``, zeroshard/runtime/grouping.py). Each group's
    params are in the engine's buffer order: its units' params in the bucket's unit order, each
    unit's in model order, then decaying ones first (``decay_first``); a checkpoint saved before that
    last rule is laid out as a run reads it now."""
    def decaying_first(params: list[str]) -> list[str]:
        return decay_first(params, lambda f: (f, torch.Size(whole[f]["shape"])))

    if ep > 1 or not any("ep" in p for p in whole.values()):
        return [dict(group, params=decaying_first(group["params"])) for group in manifest["groups"]]
    order = {p["fqn"]: i for i, p in enumerate(full_params(manifest))}
    merged: dict[tuple, dict] = {}
    for group in manifest["groups"]:
        key = (group["unit"], group["trainable"], group["master_dtype"], group["compute_dtype"])
        if key in merged:
            merged[key]["params"] += group["params"]
        else:
            merged[key] = dict(group, params=list(group["params"]))
    for group in merged.values():
        units = group["unit"].split(BUCKET_JOIN)
        group["params"] = decaying_first(sorted(group["params"], key=lambda f: (_unit_of(f, units), order[f])))
    return list(merged.values())


def _unit_of(fqn: str, units: list[str]) -> int:
    """The index in ``units`` (a bucket's, in its order) of the unit holding param ``fqn``: the module
    prefix of it (units are disjoint), else the root."""
    for index, unit in enumerate(units):
        if unit != ROOT and fqn.startswith(unit + "."):
            return index
    return units.index(ROOT) if ROOT in units else len(units)


def _expert_block(param: dict, ep: int) -> list[int] | None:
    """The shape of one ep rank's block of expert param ``param`` at degree ``ep`` (None: not split)."""
    if ep == 1 or "ep" not in param:
        return None
    return [param["shape"][0] // ep, *param["shape"][1:]]


def _target(param: dict, tp: int, tp_plan: str | None, saved_tp: bool, directory: Path) -> dict | None:
    """A whole param's placement at degree ``tp`` (None: whole on every tp rank)."""
    if tp == 1:
        return None
    if "view" in param:  # saved tp-sharded: the same dim and chunks at the new degree
        saved = param["sources"][0]["tp"]
        target: dict | None = {"placement": "shard", "dim": saved["dim"], "chunks": saved["chunks"], "tp": tp}
    elif saved_tp:  # saved whole by a tensor-parallel run: replicated in its plan
        return None
    elif tp_plan is None:
        raise CheckpointError(f"{directory} was saved without tensor parallelism, so it records no tp placements; "
                              f"pass the model's plan (--tp-plan {' or '.join(NAMED_TP_PLANS)}) or --tp 1; a "
                              "transformers model_type whose config declares a plan is a plan name too")
    else:
        try:
            target = placement_of(named_tp_plan(tp_plan), param["fqn"], len(param["shape"]), tp)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    if target is None:
        return None
    size = param["shape"][target["dim"]]
    if size % (target["chunks"] * tp):
        raise CheckpointError(f"tp {tp} does not split dim {target['dim']} ({size}) of param {param['fqn']!r} into "
                              f"{target['chunks']} x {tp} equal parts; pick a tp that divides it")
    return target


def _local_shape(param: dict, target: dict | None, tp: int) -> list[int]:
    shape = list(param["shape"])
    if target is not None:
        shape[target["dim"]] //= tp
    return shape


def _source(param: dict, target: dict | None, tp_rank: int) -> dict:
    """What ``PieceReader.fill`` reads for tp rank ``tp_rank``'s part: the view ``zs.load`` builds
    (saved parts or the whole param, joined then cut), or the saved whole param itself."""
    if target is None and "view" not in param:
        return param
    sources = param["sources"] if "view" in param else [param]
    return {"view": True, "fqn": param["fqn"], "sources": sources, "target": target, "tp_rank": tp_rank,
            "state": param["state"]}


def _part_name(fqn: str, target: dict | None, tp_rank: int) -> str:
    return fqn if target is None else f"{fqn}{TP_PART}{tp_rank}"


def _rank_jobs(groups: list[dict], whole: dict[str, dict], targets: dict[str, dict | None], reader: PieceReader,
               rank: int, dp: int, tp: int, ep: int, file: str, pieces: dict[str, list[dict]]
               ) -> list[tuple[Entry, dict, str, int]]:
    """(entry, source, kind, start) for everything rank ``rank`` of (dp, tp) writes; records its pieces.
    Its flat groups are laid out from the tp-local shapes, as the runtime lays them out; a param
    whole on every tp rank is written by tp rank 0 only (as ``pieces.saved_name``). A group of
    expert params at ``ep`` > 1 is laid out from one block's shapes over the rank's edp ranks,
    its pieces at the rank's block (``pieces.saved_extent``)."""
    tp_rank, dp_rank = rank % tp, rank // tp
    jobs = []
    for group in groups:
        blocks = [_expert_block(whole[f], ep) for f in group["params"]]
        experts = bool(blocks) and all(b is not None for b in blocks)
        shapes = [b if experts and b is not None else _local_shape(whole[f], targets[f], tp)
                  for f, b in zip(group["params"], blocks)]
        shards, index = (dp // ep, dp_rank // ep) if experts else (dp, dp_rank)
        layout = FlatLayout([(f, torch.Size(shape)) for f, shape in zip(group["params"], shapes)], shards)
        for _, slot, a, b in owned_slots(layout, *layout.shard_range(index)):
            param, target = whole[slot.fqn], targets[slot.fqn]
            if target is None and tp_rank:
                continue
            block = (dp_rank % ep) * slot.numel if experts else 0
            name, start, stop = _part_name(slot.fqn, target, tp_rank), block + a - slot.offset, block + b - slot.offset
            pieces.setdefault(name, []).append({"file": file, "start": start, "stop": stop})
            source = _source(param, target, tp_rank)
            for kind in ["master"] + [f"optim.{s}" for s in param["state"]]:
                jobs.append((Entry(fmt.piece_key(kind, name, start, stop), _stored_dtype(reader, param, kind, start),
                                   (stop - start,)), source, kind, start))
    return jobs


def _entries(param: dict, target: dict | None, tp: int, pieces: dict[str, list[dict]], world: int,
             ep: int) -> list[dict]:
    """The new manifest's entries for one whole param: itself (an expert param with its placement
    at ``ep``), or one part per tp rank with its placement."""
    plain = {k: v for k, v in _plain(param).items() if k != "ep"}
    if target is None:
        placement = split_over(ep, world // ep) if _expert_block(param, ep) is not None else None
        return [dict(plain, pieces=pieces.get(param["fqn"], []), **({"ep": placement} if placement else {}))]
    shape = _local_shape(param, target, tp)
    return [dict(plain, fqn=_part_name(param["fqn"], target, r), aliases=[], shape=shape,
                 pieces=pieces.get(_part_name(param["fqn"], target, r), []),
                 tp=dict(target, of=param["fqn"], rank=r, aliases=list(plain["aliases"]), full_shape=param["shape"]))
            for r in range(tp)]


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
