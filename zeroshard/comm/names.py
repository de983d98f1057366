"""The names the comm layer and the ledger speak: mesh dims, the groups built from them, and phases.

They are string enums so that a record written to ``ledger.jsonl`` or compared in a test reads
``"shard"``, not ``"Group.SHARD"``, while code that names a group or a phase gets a typo caught at
import time instead of as a ``KeyError`` in the middle of a step.
"""

from __future__ import annotations

import enum


class _Name(str, enum.Enum):
    """A ``str`` whose text is its value (``enum.StrEnum`` from Python 3.11, written out for 3.10)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Dim(_Name):
    """A dim of the parallel mesh, outermost first (``MESH_DIMS``).

    ``pp`` is outermost so that a pipeline stage's data- and tensor-parallel groups stay inside a
    node; ``tp`` is innermost because its per-layer all-reduces sit on the critical path and must
    run on the fastest links. ``ep`` is not a factor of the world of its own: experts are split over
    ranks that are already data parallel, the way DeepSpeed and torchtitan lay them out.
    """

    PP = "pp"
    REPLICATE = "replicate"
    SHARD = "shard"
    CP = "cp"
    """Context parallelism: the ranks one sequence is split over (between shard and tp)."""
    TP = "tp"
    EP = "ep"


class Group(_Name):
    """A group a collective runs on: one mesh dim, or a span of several."""

    WORLD = "world"
    """Every rank of the mesh."""
    REPLICATE = "replicate"
    SHARD = "shard"
    """ZeRO's group: shard × cp (a cp rank's grads sum like a data-parallel rank's)."""
    TP = "tp"
    DP = "dp"
    """replicate × shard × cp: every rank with this rank's tp index (the world without tp)."""
    CP = "cp"
    """The ranks one sequence is split over: attention's exchanges (ring p2p, Ulysses all-to-all)."""
    PP = "pp"
    """One rank per pipeline stage, with this rank's (replicate, shard, tp) index: the sends and receives."""
    PP_ENDS = "pp_ends"
    """The first and last rank of a pp group: the tied embedding/head grad is summed over it."""
    EP = "ep"


class Phase(_Name):
    """What a collective served; the profiler, the doctor and the schedule group by it."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    PARAM_SYNC = "param_sync"
    """Stages 1-2: the updated shards gathered back into the full params after the optimizer step."""
    OWNER_EXCHANGE = "owner_exchange"
    """A per-tensor optimizer's step: reduced grads and masters of each param sent whole to its owner
    rank, and the updated values sent back to the ranks whose shards hold them."""
    INIT = "init"
    CLIP = "clip"
    GRAD_SCALER = "grad_scaler"
    GUARD = "guard"
    """The non-finite guard's own traffic (zeroshard/runtime/guard.py): the norm it computes when the
    step did not clip, its flag where the norm's reduction does not span the world, and the diagnosis
    of a bad step. Not part of the step schedule, like the scaler's flag and the metrics."""
    STATE_DICT = "state_dict"
    EXPORT = "export"
    CHECKPOINT = "checkpoint"
    METRICS = "metrics"
    DESYNC = "desync"
    BARRIER = "barrier"
    CALIBRATE = "calibrate"
    USER = "user"
    """Code outside zeroshard called torch.distributed itself (zeroshard.observing routes it here)."""


def group_of(name: str | Group) -> Group:
    """``name`` as a ``Group``, or a one-line error listing the valid names."""
    try:
        return Group(name)
    except ValueError:
        valid = ", ".join(repr(g.value) for g in Group)
        raise ValueError(f"unknown group {name!r}; expected one of {valid}") from None
