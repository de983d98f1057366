"""The candidates `zeroshard tune` tries: stage x prefetch x reshard x bucket size x checkpointing
x quantized communication (x schedule x microbatches under a pipeline, x ep for an MoE model, x cp).

Each knob only enters the grid where the runtime reads it, as the runtime says: ``StagePolicy.reads``
for the engine's knobs (prefetch and reshard_after_forward at stage 3, bucket_mb at stages 0-2),
``CommQuant.problem_with`` for quantized communication (weights at stage 3, grads at stages 2-3).
So no two candidates differ only in a setting that does nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

from zeroshard.comm.quant import CommQuant
from zeroshard.trainer.config import STAGES
from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.options import KNOBS, EngineOptions

T = TypeVar("T")

DEFAULT_AXES = {"stages": "0,1,2,3", "prefetch": "1,2", "bucket_mb": "5,25", "checkpointing": "none,sqrt",
                "reshard": "true,false", "comm_quant": "none"}
_EXAMPLES = {"--" + axis.replace("_", "-"): text for axis, text in DEFAULT_AXES.items()} | {
    "--pp-schedules": "1f1b,gpipe", "--microbatch-counts": "2,4,8", "--ep-degrees": "1,2,4",
    "--cp-degrees": "1,2,4"}
LAYOUT = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
"""The planner's name for each stage's layout."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    stage: int
    checkpointing: str
    bucket_mb: float | None = None
    """None where the stage's engine does not read it (``StagePolicy.reads``): stage 3."""
    prefetch: int | None = None
    """None at stages 0-2, which gather no params."""
    reshard_after_forward: bool | None = None
    """None at stages 0-2."""
    comm_quant: str = "none"
    """Quantized communication (TrainConfig.comm_quant), only where the stage accepts it."""
    pp_schedule: str | None = None
    """Under a pipeline (pp > 1), torch's schedule; None keeps the base config's."""
    microbatches: int | None = None
    """Under a pipeline, microbatches per schedule run; None keeps the base config's."""
    ep: int | None = None
    """Expert parallelism's degree (TrainConfig.ep) where --ep-degrees searches it; None keeps the base config's."""
    cp: int | None = None
    """Context parallelism's degree (TrainConfig.cp) where --cp-degrees searches it; None keeps the base config's."""

    @property
    def name(self) -> str:
        knobs = []
        if self.prefetch is not None:
            knobs.append(f"prefetch {self.prefetch}")
        if self.reshard_after_forward is not None:
            knobs.append("reshard" if self.reshard_after_forward else "no reshard")
        if self.bucket_mb is not None:
            knobs.append(f"bucket {self.bucket_mb:g} MB")
        comm = "" if self.comm_quant == "none" else f", comm {self.comm_quant}"
        pipe = "".join([f", {self.pp_schedule}" if self.pp_schedule else "",
                        f", {self.microbatches} microbatches" if self.microbatches else ""])
        ep = "" if self.ep is None else f", ep {self.ep}"
        cp = "" if self.cp is None else f", cp {self.cp}"
        return f"stage {self.stage}, {', '.join(knobs)}, ckpt {self.checkpointing}{comm}{pipe}{ep}{cp}"

    def train_keys(self) -> dict[str, Any]:
        """The TrainConfig keys this candidate sets; knobs its stage ignores keep the base config's values."""
        keys: dict[str, Any] = {"stage": self.stage, "checkpointing": self.checkpointing,
                                "comm_quant": self.comm_quant}
        searched = {"prefetch": self.prefetch, "reshard_after_forward": self.reshard_after_forward,
                    "bucket_mb": self.bucket_mb, "pp_schedule": self.pp_schedule, "microbatches": self.microbatches,
                    "ep": self.ep, "cp": self.cp}
        keys.update({knob: value for knob, value in searched.items() if value is not None})
        return keys


@dataclasses.dataclass(frozen=True, kw_only=True)
class Axes:
    stages: tuple[int, ...]
    prefetch: tuple[int, ...]
    bucket_mb: tuple[float, ...]
    checkpointing: tuple[str, ...]
    reshard: tuple[bool, ...]
    comm_quant: tuple[str, ...] = ("none",)
    pp_schedules: tuple[str | None, ...] = (None,)
    """Searched only under a pipeline; (None,): the base config's schedule."""
    microbatches: tuple[int | None, ...] = (None,)
    ep: tuple[int | None, ...] = (None,)
    """Expert-parallel degrees; (None,): the base config's ep."""
    cp: tuple[int | None, ...] = (None,)
    """Context-parallel degrees; (None,): the base config's cp."""


def _split(flag: str, text: str, convert: Callable[[str], T]) -> tuple[T, ...]:
    items = [part.strip() for part in str(text).split(",")]
    if not items or any(not part for part in items):
        raise ValueError(f"{flag} {text!r}: give a comma-separated list such as {_EXAMPLES[flag]!r}")
    out: list[T] = []
    for part in items:
        value = convert(part)
        if value not in out:  # a repeated value would be measured twice under two names
            out.append(value)
    return tuple(out)


def _stage(part: str) -> int:
    if not part.isdigit() or int(part) not in STAGES:
        raise ValueError(f"--stages: {part!r} is not a stage; use 0 (DDP), 1, 2 or 3")
    return int(part)


_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
_KINDS = {int: "an integer", float: "a finite number", bool: "true or false", str: "text"}


def _knob(flag: str, knob: str) -> Callable[[str], Any]:
    """One grid value of the engine knob ``knob``: parsed as the knob table types it and checked by
    the engine's own options, so the grid refuses exactly what ``zs.shard`` refuses."""
    kind = next(k.type for k in KNOBS if k.name == knob)

    def parse(part: str) -> Any:
        try:
            value = _BOOLS[part.lower()] if kind is bool else kind(part)
            if isinstance(value, float) and value == float("inf"):
                raise ValueError("inf")
            EngineOptions.from_flat({knob: value})
        except (KeyError, ValueError) as e:
            why = str(e) if isinstance(e, ValueError) and "=" in str(e) else f"it is not {_KINDS[kind]}"
            raise ValueError(f"{flag}: {part!r} is not a value of {knob}: {why}; e.g. {_EXAMPLES[flag]}") from None
        return value
    return parse


_COMM_PARTS = ("weights", "grads", "grads+ef")


def _comm_quant(part: str) -> str:
    """One --comm-quant value: none, or '+'-free parts joined by '/' (the list itself is comma-separated),
    e.g. none,weights/grads,weights/grads+ef."""
    parts = part.split("/")
    if part != "none" and (any(p not in _COMM_PARTS for p in parts) or len(set(parts)) != len(parts)
                           or {"grads", "grads+ef"} <= set(parts)):
        raise ValueError(f"--comm-quant: {part!r} is not a setting; use none, weights, grads, grads+ef, or "
                         "weights/grads (a '/' joins what one candidate quantizes), e.g. none,weights/grads")
    return ",".join(parts)


def comm_quant_applies(comm_quant: str, stage: int) -> bool:
    """Whether the runtime accepts ``comm_quant`` at ``stage``: the runtime's own rule, asked."""
    return CommQuant.parse(comm_quant).problem_with(StagePolicy(stage)) is None


def _schedule(part: str) -> str:
    from zeroshard.parallel.pipeline.schedules import schedule_spec

    return schedule_spec(part).name  # torch's schedules, as the runtime names them; refuses the rest


def _count(part: str) -> int:
    if not part.isdigit() or int(part) < 1:
        raise ValueError(f"--microbatch-counts: {part!r} is not a count of microbatches; e.g. 2,4,8")
    return int(part)


def _degree(part: str, flag: str = "--ep-degrees", what: str = "an expert-parallel", dim: str = "ep") -> int:
    if not part.isdigit() or int(part) < 1:
        raise ValueError(f"{flag}: {part!r} is not {what} degree; e.g. 1,2,4 (1 is no {dim})")
    return int(part)


def _cp_degree(part: str) -> int:
    return _degree(part, "--cp-degrees", "a context-parallel", "cp")


def _schedule_takes(schedule: str | None, checkpointing: str) -> bool:
    """Whether the runtime runs ``checkpointing`` under ``schedule`` (None: the base config's, checked
    when the candidate is planned)."""
    from zeroshard.parallel.pipeline.schedules import check_checkpointing, schedule_spec

    if schedule is None:
        return True
    try:
        check_checkpointing(schedule_spec(schedule), checkpointing)
    except ValueError:
        return False
    return True


def parse_axes(*, stages: str, prefetch: str, bucket_mb: str, checkpointing: str, reshard: str,
               comm_quant: str = "none", pp_schedules: str | None = None,
               microbatches: str | None = None, ep_degrees: str | None = None, cp_degrees: str | None = None) -> Axes:
    """Comma-separated flag values to typed axes; a bad value raises ValueError naming its flag."""
    return Axes(ep=_split("--ep-degrees", ep_degrees, _degree) if ep_degrees else (None,),
                cp=_split("--cp-degrees", cp_degrees, _cp_degree) if cp_degrees else (None,),
                pp_schedules=_split("--pp-schedules", pp_schedules, _schedule) if pp_schedules else (None,),
                microbatches=_split("--microbatch-counts", microbatches, _count) if microbatches else (None,),
                stages=_split("--stages", stages, _stage),
                prefetch=_split("--prefetch", prefetch, _knob("--prefetch", "prefetch")),
                bucket_mb=_split("--bucket-mb", bucket_mb, _knob("--bucket-mb", "bucket_mb")),
                checkpointing=_split("--checkpointing", checkpointing, _knob("--checkpointing", "checkpointing")),
                reshard=_split("--reshard", reshard, _knob("--reshard", "reshard_after_forward")),
                comm_quant=_split("--comm-quant", comm_quant, _comm_quant))


def candidates(axes: Axes) -> list[Candidate]:
    """Every combination of the axes, each knob searched only at the stages whose engine reads it
    (``StagePolicy.reads``); the rest stay None and keep the base config's value."""
    out: list[Candidate] = []
    for stage in axes.stages:
        policy = StagePolicy(stage)

        def values(knob: str, axis: tuple) -> tuple:
            return axis if policy.reads(knob) else (None,)

        comms = [q for q in axes.comm_quant if comm_quant_applies(q, stage)]
        out += [Candidate(stage=stage, checkpointing=ckpt, comm_quant=comm, prefetch=p, reshard_after_forward=r,
                          bucket_mb=b, pp_schedule=sched, microbatches=m, ep=ep, cp=cp)
                for ep in axes.ep for cp in axes.cp for sched in axes.pp_schedules for m in axes.microbatches
                for ckpt in axes.checkpointing if _schedule_takes(sched, ckpt) for comm in comms
                for p in values("prefetch", axes.prefetch)
                for r in values("reshard_after_forward", axes.reshard)
                for b in values("bucket_mb", axes.bucket_mb)]
    return out


def default_candidates() -> list[Candidate]:
    return candidates(parse_axes(**DEFAULT_AXES))

