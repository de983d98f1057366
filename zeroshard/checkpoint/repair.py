"""``zeroshard ckpt repair``: rebuild a lost or damaged manifest from intact rank files.

Every rank file's header carries that rank's report and the sha256 of each of its tensors, and
rank 0's also the manifest skeleton (zeroshard/checkpoint/rankfile.py). Repair checks every rank
file on its own (header, every tensor's bytes against its recorded sha256), assembles the manifest
exactly as a save does, keeps the damaged manifest as ``manifest.json.damaged`` (never deleted) and
verifies the result. A damaged or missing rank file cannot be salvaged: repair refuses, naming it,
and writes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.manifest import CHECKSUMS_KEY, REPORT_KEY, SKELETON_KEY, assemble
from zeroshard.checkpoint.tensorfile import Stored, TensorFile, file_sha256
from zeroshard.checkpoint.verify import problems, verify

DAMAGED_SUFFIX = ".damaged"
_CHUNK = 2**20


@dataclasses.dataclass
class Repaired:
    path: Path
    files: int
    kept_as: Path | None
    """Where the damaged manifest was moved (None when there was none)."""


def _stored_sha256(opened: TensorFile, stored: Stored) -> str:
    digest = hashlib.sha256()
    fd = opened.file_descriptor()
    position = stored.begin
    while position < stored.end:
        chunk = os.pread(fd, min(_CHUNK, stored.end - position), position)
        if not chunk:
            break
        digest.update(chunk)
        position += len(chunk)
    return digest.hexdigest()


def check_rank_file(path: Path, rank: int) -> tuple[dict, dict | None]:
    """(report with the file's sha256 and size, skeleton or None) of an intact rank file; raises
    :class:`CheckpointError` naming the file when it is damaged or carries no salvage data."""
    opened = TensorFile(path, str(path))
    try:
        meta = opened.metadata
        if REPORT_KEY not in meta or CHECKSUMS_KEY not in meta:
            raise CheckpointError(f"checkpoint file {path} carries no salvage data (it was written by an older "
                                  "zeroshard); its manifest cannot be rebuilt")
        try:
            report, checksums = json.loads(meta[REPORT_KEY]), json.loads(meta[CHECKSUMS_KEY])
            frame = json.loads(meta[SKELETON_KEY]) if SKELETON_KEY in meta else None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"checkpoint file {path} has damaged salvage data in its header ({e})") from None
        if report.get("rank") != rank or report.get("file") != path.name:
            raise CheckpointError(f"checkpoint file {path} says it is rank {report.get('rank')}'s "
                                  f"{report.get('file')!r}; it was renamed or comes from elsewhere")
        if set(checksums) != set(opened.tensors):
            raise CheckpointError(f"checkpoint file {path}: its tensors do not match the checksums its header lists")
        for name, stored in opened.tensors.items():
            if _stored_sha256(opened, stored) != checksums[name]:
                raise CheckpointError(f"checkpoint file {path} is damaged: tensor {name!r} does not match its "
                                      "recorded sha256; this file cannot be salvaged")
    finally:
        opened.close()
    digest, size = file_sha256(path)
    return dict(report, sha256=digest, bytes=size), frame


def repair(directory: str | os.PathLike) -> Repaired:
    """Rebuild ``directory/manifest.json`` from its rank files and verify it (see the module doc)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at {directory}: not a directory")
    rank0 = directory / fmt.rank_file(0)
    if not rank0.is_file():
        raise CheckpointError(f"{rank0} is missing: rank 0's file holds the manifest skeleton, so the manifest "
                              "cannot be rebuilt without it")
    first, frame = check_rank_file(rank0, 0)
    if frame is None:
        raise CheckpointError(f"checkpoint file {rank0} carries no manifest skeleton; it cannot be rebuilt")
    world = frame["world"]
    present = {p.name for p in directory.glob(fmt.RANK_FILE_PATTERN)}
    expected = [fmt.rank_file(r) for r in range(world)]
    missing = [n for n in expected if n not in present]
    if missing:
        raise CheckpointError(f"{directory / missing[0]} is missing (the checkpoint was saved on {world} ranks); "
                              "its pieces are lost, so the manifest cannot be rebuilt")
    stray = sorted(present - set(expected))
    if stray:
        raise CheckpointError(f"{directory / stray[0]} does not belong to a checkpoint saved on {world} ranks; "
                              "move it away and repair again")
    reports = [first] + [check_rank_file(directory / expected[r], r)[0] for r in range(1, world)]
    manifest = assemble(frame, reports)
    kept_as = None
    old = directory / fmt.MANIFEST
    if old.exists():
        kept_as = old.with_name(fmt.MANIFEST + DAMAGED_SUFFIX)
        n = 2
        while kept_as.exists():
            kept_as = old.with_name(f"{fmt.MANIFEST}{DAMAGED_SUFFIX}-{n}")
            n += 1
        os.rename(old, kept_as)
    fmt.write_manifest(directory, manifest)
    verify(directory)
    return Repaired(directory, len(reports), kept_as)


def needs_repair(directory: Path) -> bool:
    return bool(problems(directory))
