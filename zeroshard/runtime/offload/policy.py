"""What to offload, and where."""

from __future__ import annotations

import dataclasses
from pathlib import Path


OFFLOAD_KINDS = ("none", "cpu", "disk")
"""Where fp32 masters and optimizer state live: with the params, in host memory, or in files."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPolicy:
    kind: str = "none"
    """none: masters and optimizer state live with the params. cpu: in host memory (pinned when
    the params are on an accelerator), with the optimizer step run on the CPU. disk: in files under
    ``directory``, stepped slice by slice with the next slice prefetched."""
    directory: str | None = None
    """For kind="disk": where the files go (a per-process subdirectory is created and removed)."""
    slice_mb: float = 64.0
    """For kind="disk": optimizer step granularity; one slice of masters and state is resident."""

    def require_directory(self) -> None:
        """A disk policy without a directory describes a run (the planner prices one) but cannot run."""
        if self.kind == "disk" and not self.directory:
            raise ValueError("offload='disk' needs a directory for its files: pass offload_dir / --offload-dir")

    def __post_init__(self) -> None:
        if self.kind not in OFFLOAD_KINDS:
            raise ValueError(f"offload must be 'none', 'cpu' or 'disk', got {self.kind!r}")
        if self.kind == "disk" and self.directory and Path(self.directory).exists() and not Path(self.directory).is_dir():
            raise ValueError(f"offload directory {self.directory!r} exists and is not a directory")
        if self.slice_mb <= 0:
            raise ValueError(f"slice_mb must be positive, got {self.slice_mb}")

    @property
    def slice_numel(self) -> int:
        """Parameters per disk-offload optimizer slice: ``slice_mb`` of fp32 masters."""
        return int(self.slice_mb * 2**20 / 4)

    @property
    def enabled(self) -> bool:
        return self.kind != "none"
