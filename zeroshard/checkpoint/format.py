"""The on-disk format: directory layout, manifest schema, tensor names, path safety, JSON codec.

A checkpoint is one directory::

    step-00000100/
        manifest.json          everything that is not a tensor, plus the sha256 of every file
        rank-00000.safetensors this rank's pieces: masters and optimizer moments, plus per-rank RNG
        rank-00001.safetensors ...

Tensors are stored as *pieces*: the elements ``[start, stop)`` of one flattened param, whatever
flat buffer, stage or world size they came from. That is what makes a checkpoint loadable at any
world size and stage: a loader asks for the element ranges it owns and reads them from whichever
pieces overlap. docs/checkpoints.md describes the format for readers of the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.errors import CheckpointError

FORMAT = "zeroshard-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
RANK_META_KEY = "zeroshard.rank"
"""Key of the per-rank JSON (rank, RNG states) in each rank file's safetensors metadata."""
SET_ASIDE_SUFFIX = ".corrupt"
"""A checkpoint that failed verification is renamed ``<name>.corrupt`` (never deleted); discovery
skips such names."""
RANK_FILE_PATTERN = "rank-*.safetensors"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "format": str, "version": int, "step": (int, type(None)), "world": int, "stage": int,
    "params": list, "buffers": list, "groups": list, "ranks": list, "files": dict,
}


def is_set_aside(name: str) -> bool:
    """A directory name that rotation gave a checkpoint which failed verification."""
    return SET_ASIDE_SUFFIX in name


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def piece_key(kind: str, fqn: str, start: int, stop: int) -> str:
    """Tensor name of one piece: ``master/blocks.0.attn.qkv.weight@0:12288``; ``kind`` is
    ``master`` or ``optim.<state name>``."""
    return f"{kind}/{fqn}@{start}:{stop}"


def buffer_key(name: str) -> str:
    return f"buffer/{name}"


def safe_member(directory: Path, name: Any, what: str) -> Path:
    """``directory / name`` for a plain file name from a manifest; anything that could escape the
    directory (``..``, separators, absolute paths, odd characters) is refused, never opened."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name or os.sep in name:
        raise CheckpointError(
            f"{directory / MANIFEST}: {what} names the file {name!r}, which is not a plain file name inside "
            "the checkpoint directory; refusing it (the manifest is corrupt or was tampered with)")
    return directory / name


def pointed_by_latest(path: Path) -> Path | None:
    """The directory a ``latest`` pointer names, when ``path`` is that pointer file (``ckpt/latest``,
    what a user types after seeing it in ``ls ckpt``) or a root holding one; else None. Whether the
    directory is a complete checkpoint is the caller's question."""
    pointer = path if path.name == LATEST and path.is_file() else path / LATEST
    return follow_pointer(pointer) if pointer.is_file() else None


def follow_pointer(pointer: Path) -> Path:
    """The checkpoint directory next to the ``latest`` file ``pointer`` that it names."""
    return safe_member(pointer.parent, pointer.read_text().strip(), f"the pointer {pointer}")


# --------------------------------------------------------------------------- JSON codec
# Optimizer options and scheduler/scaler state hold tuples (AdamW betas) and sometimes 0-dim
# tensors; they are tagged so that load_state_dict gets back exactly the types it saved.


def to_json(value: Any, where: str) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v, where) for v in value]}
    if isinstance(value, list):
        return [to_json(v, where) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(f"{where}: key {k!r} is not a str or int, so it cannot be stored as JSON")
            out[str(k) if isinstance(k, str) else f"__int__{k}"] = to_json(v, f"{where}.{k}")
        return out
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {"__tensor__": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    raise CheckpointError(
        f"{where} holds a {type(value).__name__}, which a checkpoint cannot store (JSON only, never pickle); "
        "keep state_dict() to numbers, strings, lists, dicts and 0-dim tensors")


def from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(from_json(v) for v in value["__tuple__"])
        if set(value) == {"__tensor__", "dtype"}:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        if set(value) == {"__dtype__"}:
            return getattr(torch, value["__dtype__"])
        return {(int(k[len("__int__"):]) if k.startswith("__int__") else k): from_json(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- manifest I/O


def _digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a file's fsync does not cover its name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_manifest(directory: Path, manifest: dict) -> None:
    # The manifest carries its own digest so that an edited or bit-flipped manifest is caught too,
    # not only the tensor files it lists.
    manifest = dict(manifest, manifest_sha256=_digest(manifest))
    write_json_atomic(directory / MANIFEST, manifest)


def read_manifest(directory: Path) -> dict:
    """Parse and validate ``directory/manifest.json``: schema, self digest and path safety."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        partial = " (an interrupted save leaves no manifest)" if directory.is_dir() else ""
        raise CheckpointError(f"{path} does not exist: {directory} is not a complete checkpoint{partial}")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a zeroshard checkpoint manifest (format != {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {manifest.get('version')!r}; this zeroshard reads "
                              f"version {VERSION}")
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{path}: key {key!r} is missing or has the wrong type")
    if manifest.get("manifest_sha256") != _digest(manifest):
        raise CheckpointError(f"{path}: manifest checksum mismatch; the manifest was modified or corrupted")
    for name in manifest["files"]:
        safe_member(directory, name, "the files table")
    for rank in manifest["ranks"]:
        _check_listed(directory, manifest, rank.get("file"), f"rank {rank.get('rank')}")
    for param in manifest["params"]:
        for piece in param.get("pieces", []):
            _check_listed(directory, manifest, piece.get("file"), f"param {param.get('fqn')!r}")
    for buffer in manifest["buffers"]:
        _check_listed(directory, manifest, buffer.get("file"), f"buffer {buffer.get('name')!r}")
    return manifest


def _check_listed(directory: Path, manifest: dict, name: Any, what: str) -> None:
    safe_member(directory, name, what)
    if name not in manifest["files"]:
        raise CheckpointError(f"{directory / MANIFEST}: {what} refers to {name!r}, which is not in the files table")


def check_coverage(manifest: dict, where: Path) -> None:
    """Every param's pieces must tile ``[0, numel)`` exactly: no gap (lost values), no overlap."""
    for param in manifest["params"]:
        numel = 1
        for d in param["shape"]:
            numel *= d
        position = 0
        for piece in sorted(param["pieces"], key=lambda p: p["start"]):
            if piece["start"] != position or piece["stop"] <= piece["start"]:
                raise CheckpointError(f"{where / MANIFEST}: the pieces of param {param['fqn']!r} do not tile its "
                                      f"{numel} elements (break at element {position})")
            position = piece["stop"]
        if position != numel:
            raise CheckpointError(f"{where / MANIFEST}: the pieces of param {param['fqn']!r} cover {position} of "
                                  f"{numel} elements")


def git_revision() -> str | None:
    """The commit of the zeroshard source tree when it is a git checkout (read from .git, no git call)."""
    env = os.environ.get("ZEROSHARD_GIT_REV")
    if env:
        return env
    here = Path(__file__).resolve()
    for parent in here.parents:
        git = parent / ".git"
        if git.is_dir():
            try:
                head = (git / "HEAD").read_text().strip()
                if not head.startswith("ref: "):
                    return head
                ref = head[5:]
                loose = git / ref
                if loose.is_file():
                    return loose.read_text().strip()
                packed = git / "packed-refs"
                if packed.is_file():
                    for line in packed.read_text().splitlines():
                        if line.endswith(" " + ref):
                            return line.split()[0]
            except OSError:
                return None
            return None
    return None
