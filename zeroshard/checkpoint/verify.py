"""Verification: is every file the manifest lists present, intact and shaped as the manifest says?

Checks, in order of cost: the manifest (schema, its own digest, path safety, piece coverage); each
file's size (a truncated file is named as truncated); its sha256 (any flipped byte); then its
safetensors header against every piece and buffer the manifest places in it. No process group is
needed, so the same code serves ``zs.load``, ``--resume auto`` and ``zeroshard ckpt verify``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.tensorfile import TensorFile, file_sha256, parse_dtype


def expected_tensors(manifest: dict) -> dict[str, dict[str, tuple[str | None, int]]]:
    """file -> tensor name -> (dtype or None when not recorded, numel)."""
    out: dict[str, dict[str, tuple[str | None, int]]] = {name: {} for name in manifest["files"]}
    for param in manifest["params"]:
        for piece in param["pieces"]:
            numel = piece["stop"] - piece["start"]
            names = out.setdefault(piece["file"], {})
            names[fmt.piece_key("master", param["fqn"], piece["start"], piece["stop"])] = (param["dtype"], numel)
            for state in param["state"]:
                names[fmt.piece_key(f"optim.{state}", param["fqn"], piece["start"], piece["stop"])] = (None, numel)
    for buffer in manifest["buffers"]:
        numel = 1
        for d in buffer["shape"]:
            numel *= d
        out.setdefault(buffer["file"], {})[buffer["key"]] = (buffer["dtype"], numel)
    return out


def check_file(directory: Path, manifest: dict, name: str, expected: dict | None = None) -> None:
    """Raise :class:`CheckpointError` naming ``name`` if it is missing, truncated, corrupt or mis-shaped."""
    path = fmt.safe_member(directory, name, "the files table")
    label = str(path)
    info = manifest["files"][name]
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {label} is missing")
    size = path.stat().st_size
    if size != info["bytes"]:
        kind = "truncated" if size < info["bytes"] else "longer than recorded"
        raise CheckpointError(f"checkpoint file {label} is {kind}: {size} bytes, the manifest says {info['bytes']}")
    digest, _ = file_sha256(path)
    if digest != info["sha256"]:
        raise CheckpointError(
            f"checkpoint file {label} is corrupt: sha256 {digest[:16]}... does not match the manifest's "
            f"{info['sha256'][:16]}...; restore the file or resume from another checkpoint")
    tensors = (expected or expected_tensors(manifest)).get(name, {})
    opened = TensorFile(path, label)
    try:
        for key, (dtype, numel) in tensors.items():
            stored = opened.stored(key)
            if stored.numel != numel or (dtype is not None and stored.dtype != parse_dtype(dtype, label)):
                raise CheckpointError(f"checkpoint file {label}: tensor {key!r} is {stored.dtype} with "
                                      f"{stored.numel} elements, the manifest expects {dtype} with {numel}")
    finally:
        opened.close()


def verify(directory: str | Path, files: Iterable[str] | None = None) -> dict:
    """Verify a checkpoint (all files, or only ``files``); return its manifest or raise the first problem."""
    directory = Path(directory)
    manifest = fmt.read_manifest(directory)
    fmt.check_coverage(manifest, directory)
    expected = expected_tensors(manifest)
    for name in (manifest["files"] if files is None else sorted(set(files))):
        check_file(directory, manifest, name, expected)
    return manifest


def problems(directory: str | Path) -> list[str]:
    """Every problem found (for reports); empty when the checkpoint verifies."""
    directory = Path(directory)
    try:
        manifest = fmt.read_manifest(directory)
        fmt.check_coverage(manifest, directory)
    except CheckpointError as e:
        return [str(e)]
    expected = expected_tensors(manifest)
    found = []
    for name in manifest["files"]:
        try:
            check_file(directory, manifest, name, expected)
        except CheckpointError as e:
            found.append(str(e))
    return found


def resolve(path: str | os.PathLike) -> Path:
    """The one complete checkpoint ``path`` names: a checkpoint directory, a root holding a ``latest``
    pointer, or that pointer file itself (zeroshard/checkpoint/discover.py ``named`` is the same rule
    for the tools that also take every checkpoint of a root)."""
    path = Path(path)
    if (path / fmt.MANIFEST).is_file():
        return path
    target = fmt.pointed_by_latest(path)
    if target is not None:
        if not (target / fmt.MANIFEST).is_file():
            pointer = path if path.name == fmt.LATEST else path / fmt.LATEST
            raise CheckpointError(f"{pointer} points to {target.name!r}, which is not a complete checkpoint")
        return target
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist")
    raise CheckpointError(f"no checkpoint at {path}: it has no {fmt.MANIFEST} and no {fmt.LATEST} pointer")
