"""Finding checkpoints in a directory, and choosing the one to resume from (``--resume auto``).

Hidden entries (``.<name>.partial`` of an interrupted save, ``.<name>.deleting``) and set-aside ones
(``<name>.corrupt``) are never candidates. A directory that holds rank files but no manifest is a
checkpoint whose manifest was lost: it is listed as a fault, so that a strict resume refuses to
start over it (``zeroshard ckpt repair`` can rebuild the manifest).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.verify import resolve, verify


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
        if path.name.startswith(".") or fmt.is_set_aside(path.name) or not (path / fmt.MANIFEST).is_file():
            continue
        try:
            step = fmt.read_manifest(path)["step"]
        except CheckpointError:
            step = None
        found.append(Found(path, step, (path / fmt.MANIFEST).stat().st_mtime))
    return sorted(found, key=lambda f: (f.step if f.step is not None else -1, f.mtime), reverse=True)


def manifestless(root: str | Path) -> list[Path]:
    """Directories in ``root`` with rank files but no manifest: checkpoints whose manifest was lost."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and not fmt.is_set_aside(p.name) and not (p / fmt.MANIFEST).exists()
                  and any(p.glob(fmt.RANK_FILE_PATTERN)))


def interrupted_saves(root: str | Path) -> list[Path]:
    root = Path(root)
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith(".partial")) if root.is_dir() else []


@dataclasses.dataclass(frozen=True)
class Named:
    """The checkpoints a path given to a tool names (``named``)."""

    checkpoints: list[Path]
    root: Path | None = None
    """Set when the path was a root and ``checkpoints`` is every checkpoint in it."""


def named(path: str | os.PathLike, *, every: bool = False) -> Named:
    """The one rule by which every ``zeroshard ckpt`` action reads a path, so that ``ckpt/latest``,
    ``ckpt`` and ``ckpt/step-00000100`` mean the same to each of them:

    - the pointer file ``ROOT/latest``: the checkpoint it points to;
    - a checkpoint directory (a manifest, even a damaged one, or rank files): itself;
    - a root: the checkpoint its ``latest`` points to, or with ``every`` (verify, repair) every
      checkpoint in it, those whose manifest was lost included, oldest first.

    Without ``every`` the checkpoint must be complete (``resolve``); with it, a damaged one is
    named all the same, for the caller to report or repair. Raises CheckpointError when ``path``
    names nothing."""
    path = Path(path)
    if not every:
        return Named([resolve(path)])
    if path.name == fmt.LATEST and path.is_file():
        return Named([fmt.follow_pointer(path)])
    if (path / fmt.MANIFEST).exists() or any(path.glob(fmt.RANK_FILE_PATTERN)):
        return Named([path])
    if not path.is_dir():
        return Named([resolve(path)])  # raises: the path names nothing
    found = {f.path for f in complete_checkpoints(path)} | set(manifestless(path))
    return Named(sorted(found), root=path)


@dataclasses.dataclass
class Choice:
    """The checkpoint to resume from (None: none verifies), and every one passed over, with why."""

    path: Path | None
    step: int | None
    skipped: list[tuple[Path, str]]
    faults: list[tuple[Path, str]] = dataclasses.field(default_factory=list)
    """The skipped ones that are checkpoints (not interrupted saves, which never committed)."""
    lineage: str | None = None

    def describe(self) -> list[str]:
        lines = [f"skipped {path}: {reason}" for path, reason in self.skipped]
        if self.path is not None:
            lines.append(f"resuming from {self.path} (step {self.step})")
        elif self.faults:
            lines.append(f"none of the {len(self.faults)} checkpoints verifies")
        else:
            lines.append("no checkpoint yet; starting from step 0")
        return lines

    def refusal(self, root: str | Path) -> str:
        """The one-line error of a strict resume that found checkpoints and none that verifies (short:
        the launcher keeps one line of a rank's error; the lines above it give every reason in full)."""
        named = [f"{path.name} ({_short(path, reason)})" for path, reason in self.faults[:3]]
        more = f" and {len(self.faults) - 3} more" if len(self.faults) > 3 else ""
        return (f"--resume auto: no checkpoint in {root} verifies: {', '.join(named)}{more}; nothing was deleted. "
                "Rebuild a manifest from intact rank files with `zeroshard ckpt repair DIR`, "
                "or pass --resume fresh-ok to start from step 0 on purpose")


def _short(path: Path, reason: str) -> str:
    """A fault without the checkpoint's own path, cut at its first clause."""
    return reason.replace(f"{path}/", "").split("; ")[0]


def choose(root: str | Path) -> Choice:
    """The newest checkpoint in ``root`` that fully verifies, and every newer one skipped, with why.

    Interrupted saves (``.<name>.partial``) are always listed as skipped: they never committed.
    Checkpoints that do not verify (a manifest lost or damaged, a rank file corrupt) are listed in
    ``faults`` too, so a caller can refuse to start fresh over them.
    """
    skipped: list[tuple[Path, str]] = [(p, "interrupted save: it never committed (no manifest was written)")
                                       for p in interrupted_saves(root)]
    faults = [(p, f"rank files but no {fmt.MANIFEST}: it was lost") for p in manifestless(root)]
    for found in complete_checkpoints(root):
        try:
            manifest = verify(found.path)
        except CheckpointError as e:
            faults.append((found.path, str(e)))
            continue
        return Choice(found.path, manifest["step"], skipped + faults, faults, manifest.get("lineage"))
    return Choice(None, None, skipped + faults, faults)
