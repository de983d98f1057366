"""Finding checkpoints in a directory, and choosing the one to resume from (``--resume auto``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.verify import verify


@dataclasses.dataclass(frozen=True)
class Found:
    path: Path
    step: int | None
    mtime: float


def complete_checkpoints(root: str | Path) -> list[Found]:
    """Directories in ``root`` with a readable zeroshard manifest, newest first (by step, then time)."""
    root = Path(root)
    found: list[Found] = []
    if not root.is_dir():
        return found
    for path in root.iterdir():
        if path.name.startswith(".") or not (path / fmt.MANIFEST).is_file():
            continue
        try:
            step = fmt.read_manifest(path)["step"]
        except CheckpointError:
            step = None
        found.append(Found(path, step, (path / fmt.MANIFEST).stat().st_mtime))
    return sorted(found, key=lambda f: (f.step if f.step is not None else -1, f.mtime), reverse=True)


def interrupted_saves(root: str | Path) -> list[Path]:
    root = Path(root)
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith(".partial")) if root.is_dir() else []


@dataclasses.dataclass
class Choice:
    path: Path | None
    step: int | None
    skipped: list[tuple[Path, str]]

    def describe(self) -> list[str]:
        lines = [f"skipped {path}: {reason}" for path, reason in self.skipped]
        lines.append(f"resuming from {self.path} (step {self.step})" if self.path is not None
                     else "no checkpoint verifies; starting from step 0")
        return lines


def choose(root: str | Path) -> Choice:
    """The newest checkpoint in ``root`` that fully verifies, and every newer one skipped, with why.

    Interrupted saves (``.<name>.partial``) are always listed as skipped: they never committed.
    """
    skipped: list[tuple[Path, str]] = [(p, "interrupted save: it never committed (no manifest was written)")
                                       for p in interrupted_saves(root)]
    for found in complete_checkpoints(root):
        try:
            manifest = verify(found.path)
        except CheckpointError as e:
            skipped.append((found.path, str(e)))
            continue
        return Choice(found.path, manifest["step"], skipped)
    return Choice(None, None, skipped)
