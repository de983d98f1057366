"""Rotation (``keep_last``) and setting aside: the only code that removes or renames checkpoints.

The rule is that nothing is deleted unless it was verified first, and nothing that fails
verification is deleted at all:

- a checkpoint is deleted only when it verifies, belongs to the lineage of the run that is saving
  (``lineage`` in its manifest; another run's checkpoints in the same directory are never touched),
  is older than a newer checkpoint that has just committed *and verified*, and is past the
  ``keep_last`` newest verified ones;
- a checkpoint that fails verification is renamed to ``<name>.corrupt`` (``.corrupt-2`` ... when
  that exists) and reported; discovery ignores set-aside names, and ``zeroshard ckpt repair`` or a
  rename brings one back.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.discover import complete_checkpoints
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.verify import verify


@dataclasses.dataclass
class Rotation:
    """What one rotation did, for the caller to report."""

    deleted: list[Path] = dataclasses.field(default_factory=list)
    set_aside: list[tuple[Path, Path, str]] = dataclasses.field(default_factory=list)
    """(old path, new path, why it failed verification)."""

    def describe(self) -> list[str]:
        lines = [f"set aside {old} as {new.name}: it fails verification ({why})" for old, new, why in self.set_aside]
        lines += [f"rotated out {path} (verified, older than keep_last)" for path in self.deleted]
        return lines


def set_aside(path: Path, reason: str, into: Rotation) -> Path:
    """Rename ``path`` to ``<name>.corrupt`` (first free suffix); never deletes anything."""
    target = path.with_name(path.name + fmt.SET_ASIDE_SUFFIX)
    n = 2
    while target.exists():
        target = path.with_name(f"{path.name}{fmt.SET_ASIDE_SUFFIX}-{n}")
        n += 1
    os.rename(path, target)
    fmt.fsync_dir(path.parent)
    into.set_aside.append((path, target, reason))
    return target


def clear_target(final: Path, into: Rotation) -> None:
    """Before ``final`` is replaced by a new save of the same name: a verified checkpoint there may
    be replaced (the commit does it); anything else is set aside, never overwritten."""
    if not final.exists():
        return
    try:
        verify(final)
    except CheckpointError as e:
        set_aside(final, str(e), into)


def _delete(path: Path) -> None:
    # Renamed to a hidden name first: a crash mid-delete cannot leave a half-deleted directory that
    # looks like a checkpoint.
    trash = path.parent / f".{path.name}.deleting"
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)


_VERIFIED: dict[Path, tuple] = {}
"""Checkpoints this process verified, with the signature of their files then (see `_verify_kept`)."""


def _signature(directory: Path) -> tuple:
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()))


def _verify_kept(directory: Path) -> None:
    """Verify a checkpoint that rotation keeps. Every save looks at every kept one again, so a
    full pass is skipped when none of its files changed (names, sizes, times) since this process
    last verified it; a checkpoint about to be deleted is always verified in full."""
    signature = _signature(directory)
    if _VERIFIED.get(directory.resolve()) == signature:
        return
    verify(directory)
    _VERIFIED[directory.resolve()] = signature


def lineage_of(directory: Path) -> tuple[bool, str | None]:
    """(readable, lineage) of a checkpoint's manifest; (False, None) when the manifest is unreadable."""
    try:
        return True, fmt.read_manifest(directory).get("lineage")
    except CheckpointError:
        return False, None


def rotate(root: Path, keep_last: int, *, newest: Path, lineage: str | None) -> Rotation:
    """After ``newest`` committed: verify it, set aside every checkpoint in ``root`` that fails
    verification, and delete this lineage's verified checkpoints older than ``newest`` past the
    ``keep_last`` newest verified ones (``newest`` counts as one). ``keep_last`` 0 deletes nothing."""
    done = Rotation()
    try:
        newest_step = verify(newest)["step"]
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {newest} committed but does not verify ({e}); nothing was rotated "
                              "out. Check the disk") from None
    kept = 1
    for found in complete_checkpoints(root):
        path = found.path
        if path.resolve() == newest.resolve():
            continue
        readable, theirs = lineage_of(path)
        # Ours to count (and perhaps delete): this lineage, not newer than the new one (a newer one
        # of an abandoned attempt stays until something newer verifies).
        ours = readable and theirs == lineage and found.step is not None and newest_step is not None \
            and found.step <= newest_step
        doomed = ours and keep_last > 0 and kept >= keep_last
        try:
            if doomed:
                verify(path)
            else:
                _verify_kept(path)
        except CheckpointError as e:
            set_aside(path, str(e), done)
            continue
        if doomed:
            _delete(path)
            _VERIFIED.pop(path.resolve(), None)
            done.deleted.append(path)
        elif ours:
            kept += 1
    return done
