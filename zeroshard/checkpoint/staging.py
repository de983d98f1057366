"""Where the offline tools build an output before it is theirs: a hidden ``.<name>.partial`` beside it,
renamed onto the output only once complete, so a failure or a kill never leaves a half-written one."""

from __future__ import annotations

import shutil
from pathlib import Path

from zeroshard.checkpoint.errors import CheckpointError


def refuse_existing(out: Path, overwrite: bool, *, error: type[Exception] = CheckpointError,
                    choose: str = "output path", how: str = "--overwrite") -> None:
    """One line naming the fix when ``out`` is there and may not be replaced."""
    if out.exists() and not overwrite:
        raise error(f"{out} already exists; choose another {choose} or pass {how}")


def partial_of(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def fresh_partial(out: Path) -> Path:
    """An empty ``.<name>.partial`` folder for ``out``; one left by a killed run is cleared first."""
    partial = partial_of(out)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial
