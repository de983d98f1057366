"""What the engine shows tools of its state: where it is in a step (``TrainingState``) and the
tensors behind each kind of model-state memory (``MemorySnapshot``). Tools read these, never the
engine's fields; ``zeroshard.runtime.engine`` re-exports both."""

from __future__ import annotations

import dataclasses
import enum

import torch


class TrainingState(enum.Enum):
    """Where the engine is in a step; FSDP2 keeps the same on its param groups.

    IDLE between steps and after an eval forward; FORWARD from the model's forward pre-hook to its
    forward hook; BACKWARD from the first grad hook until autograd's end-of-graph callback. A grad
    read (optimizer, clipping) in BACKWARD would see a half-reduced step: nothing reads one then.
    """

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemorySnapshot:
    """What ``Engine.memory_snapshot`` returns: the tensors behind each kind of model-state memory
    (a tool dedups them by storage, as two may share one) and the engine's full-param counters."""

    state: TrainingState
    full_params: list[torch.Tensor]
    """Every flat group's full buffer (empty storage at stage 3 while resharded)."""
    masters: list[torch.Tensor]
    """This rank's master shards (on the host when offloaded)."""
    kept_grads: list[torch.Tensor]
    """Stages 0-1's full grad buffers, alive for the whole run."""
    full_grads: list[torch.Tensor]
    """Every full grad buffer that exists now (the kept ones, and stages 2-3's while collected)."""
    grad_shards: list[torch.Tensor]
    """The reduced grad shards that exist now."""
    transient_grads: list[torch.Tensor]
    """Grads alive only until their reduction finishes (``FlatGroup.transient_grads``)."""
    live_full_bytes: int
    peak_full_bytes: int
    """Most full-param bytes allocated at once since ``reset_memory_stats``."""
    max_unsharded_units: int
    offloaded: bool
