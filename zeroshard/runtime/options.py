"""The engine's options: every knob of the runtime's schedule and memory, in one typed record.

``zs.shard(...)`` builds an ``EngineOptions`` from its keyword arguments (or takes one whole, as
``options=``); the engine reads its knobs from here and nowhere else. ``TrainConfig`` holds one,
and the planner's spec and the tuner's grid hold one, so a knob is declared once, here.

Flags, TOML keys and a DeepSpeed migration spell the knobs flat (``prefetch = 2``,
``--offload cpu --offload-dir D``): ``KNOBS`` is that flat table, built from the fields below, and
``from_flat`` / ``flat`` convert between the two spellings.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from zeroshard.runtime.docstrings import field_docs
from zeroshard.runtime.offload.policy import OffloadPolicy
from zeroshard.runtime.recompute import segment_length

MAX_INFLIGHT_REDUCTIONS = 2
"""Stages 2-3 finish the oldest reduction while more than this many are pending. Two, so that at the
end of backward the last block's reduction is still running when the root's launches, and the
optimizer can step the other units meanwhile (see optim.py). zeroshard.tools.sim and zeroshard.tools.planner read it."""

BACKWARD_PREFETCH_AT = 0.5
"""Fraction of a unit's grads ready before its backward prefetch of earlier units is issued."""

ACCUMULATIONS = ("sharded", "unsharded")
PP_GRAD_REDUCES = ("step", "microbatch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How one sharded model is driven: prefetching, bucketing, accumulation, reduction overlap,
    activation checkpointing and offload. Validated on construction, so a bad value fails before
    the model is touched. See ``zs.shard`` for what each means to a user."""

    checkpointing: str = "none"
    """Activation checkpointing of the blocks: none, all, every:K (segments of K blocks) or sqrt
    (segments of about sqrt(L) blocks)."""

    # A string (or None) is taken as OffloadPolicy(kind=...), as zs.shard(offload=) takes it.
    offload: OffloadPolicy = dataclasses.field(default_factory=OffloadPolicy)
    """Where fp32 masters and optimizer state live: none (with the params), cpu (host memory, CPU
    optimizer step) or disk (files under offload_dir, stepped slice by slice)."""

    bucket_mb: float = 25.0
    """Gradient bucket size in MB for the overlapped reduction (stages 0-2; stage 3 reduces per unit)."""

    prefetch: int = 1
    """Stage 3 only: units whose all-gather is issued ahead of the one computing. Each extra unit
    hides more all-gather latency and holds one more block's full params; 0 gathers on demand."""

    reshard_after_forward: bool = True
    """Stage 3 only: free each unit's gathered params after its forward and gather them again for
    backward. False keeps every unit's full params from forward to backward: one all-gather fewer
    per unit, the memory of unsharded params during backward."""

    backward_prefetch_at: float = BACKWARD_PREFETCH_AT
    """Stage 3: share of a unit's grads complete before the all-gather of the unit backward needs
    next is issued. Earlier hides more of it behind the unit's backward; later issues it once more of
    the unit's activations are freed (the memory peak is at the start of a unit's backward)."""

    max_inflight_reductions: int = MAX_INFLIGHT_REDUCTIONS
    """Stages 2-3: the oldest gradient reduction is finished while more than this many are pending.
    Each pending one holds its unit's full grads; fewer bounds that memory at the cost of overlap."""

    reap_when_done: bool = True
    """Finish a gradient reduction as soon as the backend reports it complete. False finishes it only
    when max_inflight_reductions or a read forces it: what a link slower than compute gives."""

    check_schedule: bool = False
    """Debug mode: check every optimizer step's collectives against the step schedule (what the
    planner and the simulator model) and stop at the first difference, naming it."""

    accumulation: str = "sharded"
    """Stages 2-3 with gradient accumulation: 'sharded' reduce-scatters every micro-step into the 1/N
    grad shard; 'unsharded' keeps full fp32 grads across micro-steps and reduces once per step.
    Under a pipeline (pp > 1) pp_grad_reduce decides instead."""

    pp_grad_reduce: str = "step"
    """Pipeline (pp > 1), stages 2-3: when a stage's grads are reduced. 'step' keeps every
    microbatch's full grads unreduced and reduces once after the step's last microbatch (the stage's
    full grads resident all step); 'microbatch' reduce-scatters after each microbatch's backward into
    the 1/N grad shard (microbatches x the reduce-scatters, 1/N grad memory). Refused at stages 0-1,
    which keep full grads and reduce once anyway; ignored at pp 1, where accumulation is its
    counterpart. docs/pipeline.md."""

    def __post_init__(self) -> None:
        if self.offload is None or isinstance(self.offload, str):
            object.__setattr__(self, "offload", OffloadPolicy(kind=self.offload or "none"))
        try:
            segment_length(self.checkpointing, 1)
        except ValueError:
            raise ValueError(f"checkpointing={self.checkpointing!r} is invalid; use none, all, every:K (K >= 1) "
                             "or sqrt") from None
        if self.accumulation not in ACCUMULATIONS:
            raise ValueError(f"accumulation={self.accumulation!r} is invalid; use 'sharded' or 'unsharded'")
        if self.pp_grad_reduce not in PP_GRAD_REDUCES:
            raise ValueError(f"pp_grad_reduce={self.pp_grad_reduce!r} is invalid; use 'step' (once after the last "
                             "microbatch) or 'microbatch' (a reduce-scatter after each)")
        if self.prefetch < 0:
            raise ValueError(f"prefetch={self.prefetch} must be >= 0 (units gathered ahead; 0 gathers on demand)")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb={self.bucket_mb} must be > 0")
        if not 0.0 <= self.backward_prefetch_at <= 1.0:
            raise ValueError(f"backward_prefetch_at={self.backward_prefetch_at} is a share of a unit's grads; "
                             "pick a value from 0 to 1")
        if self.max_inflight_reductions < 0:
            raise ValueError(f"max_inflight_reductions={self.max_inflight_reductions} must be >= 0")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    @classmethod
    def from_flat(cls, values: Mapping[str, Any], base: EngineOptions | None = None) -> EngineOptions:
        """``base`` (the defaults when None) with the flat knobs in ``values`` on top; keys that are not
        knobs are ignored, so a whole config's values may be passed."""
        base = base if base is not None else cls()
        own = {k: v for k, v in values.items() if k in _OWN_KNOBS}
        offload = {_OFFLOAD_KNOBS[k]: v for k, v in values.items() if k in _OFFLOAD_KNOBS}
        policy = base.offload
        if offload:
            policy = OffloadPolicy(**{**dataclasses.asdict(policy), **offload})
        return dataclasses.replace(base, **own, offload=policy)

    def flat(self) -> dict[str, Any]:
        """The knobs as flags and TOML keys spell them, in ``KNOBS`` order."""
        values = {k: getattr(self, k) for k in _OWN_KNOBS}
        values.update({k: getattr(self.offload, attr) for k, attr in _OFFLOAD_KNOBS.items()})
        return {knob.name: values[knob.name] for knob in KNOBS}


@dataclasses.dataclass(frozen=True)
class Knob:
    """One engine knob as a flag and a TOML key spell it."""

    name: str
    type: Any
    """Its annotation (``int``, ``float``, ``bool``, ``str`` or ``str | None``)."""
    default: Any
    help: str


_OFFLOAD_KNOBS = {"offload": "kind", "offload_dir": "directory", "offload_slice_mb": "slice_mb"}
"""The flat names of ``OffloadPolicy``'s fields."""


def _knob_table() -> tuple[tuple[Knob, ...], tuple[str, ...]]:
    hints = typing.get_type_hints(EngineOptions)
    offload_hints = typing.get_type_hints(OffloadPolicy)
    docs, offload_docs = field_docs(EngineOptions), field_docs(OffloadPolicy)
    defaults = EngineOptions()
    knobs: list[Knob] = []
    for f in dataclasses.fields(EngineOptions):
        if f.name != "offload":
            knobs.append(Knob(f.name, hints[f.name], getattr(defaults, f.name), docs.get(f.name, "")))
            continue
        for name, attr in _OFFLOAD_KNOBS.items():
            text = docs.get("offload", "") if name == "offload" else offload_docs.get(attr, "")
            knobs.append(Knob(name, offload_hints[attr], getattr(defaults.offload, attr), text))
    own = tuple(f.name for f in dataclasses.fields(EngineOptions) if f.name != "offload")
    return tuple(knobs), own


KNOBS, _OWN_KNOBS = _knob_table()
"""Every engine knob, flat: one row per ``EngineOptions`` field, ``offload`` spread over its policy's
fields. ``TrainConfig`` makes a flag and a TOML key of each; the planner and tuner take the same names."""

KNOB_NAMES = tuple(k.name for k in KNOBS)
