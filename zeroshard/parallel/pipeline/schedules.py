"""The pipeline schedules zeroshard runs: torch's own, by name, with their rules checked up front.

No schedule is written here: each name maps to a class of ``torch.distributed.pipelining``. What
is added is the check torch makes late (or not at all), as one line that names the fix: too few
microbatches for the schedule, a microbatch count an interleaved schedule cannot split into rounds.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    name: str
    torch_class: str
    """The class's name in torch.distributed.pipelining."""
    multi: bool
    """Several stages per rank (torch's PipelineScheduleMulti)."""
    default_stages_per_rank: int
    split_backward: bool = False
    """Each backward runs as an input half and a later weight half (a zero-bubble schedule)."""


SCHEDULES = {
    "gpipe": ScheduleSpec("gpipe", "ScheduleGPipe", False, 1),
    "1f1b": ScheduleSpec("1f1b", "Schedule1F1B", False, 1),
    "interleaved-1f1b": ScheduleSpec("interleaved-1f1b", "ScheduleInterleaved1F1B", True, 2),
    "looped-bfs": ScheduleSpec("looped-bfs", "ScheduleLoopedBFS", True, 2),
    "interleaved-zero-bubble": ScheduleSpec("interleaved-zero-bubble", "ScheduleInterleavedZeroBubble", True, 2,
                                            split_backward=True),
}
"""Schedule names (``pp_schedule``). The zero-bubble one (ZB1P, stages looped over the ranks as in
interleaved 1F1B) fills the bubble with the weight halves of earlier backwards
(zeroshard/parallel/pipeline/stage.py). torch's V-shaped ones (ZBV, DualPipeV) place a rank's two stages
at both ends of the pipeline, a placement zeroshard's stage split and checkpoints do not take yet."""


def schedule_spec(name: str) -> ScheduleSpec:
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ValueError(f"pp_schedule={name!r} is not a schedule; use one of {', '.join(SCHEDULES)}")
    return spec


def stages_per_rank(spec: ScheduleSpec, asked: int) -> int:
    """``asked`` (0: the schedule's default); single-stage schedules take exactly one."""
    n = asked or spec.default_stages_per_rank
    if not spec.multi and n != 1:
        raise ValueError(f"pp_schedule={spec.name} runs one stage per rank, not pp_stages_per_rank={n}; use "
                         "interleaved-1f1b or looped-bfs for several")
    if spec.multi and n < 2:
        raise ValueError(f"pp_schedule={spec.name} needs at least 2 stages per rank, got pp_stages_per_rank={n}; "
                         "use 1f1b for one")
    return n


def microbatches_of(pp: int, *, schedule: str, microbatches: int, stages_per_rank_asked: int) -> int:
    """The microbatches a run splits each schedule run into: ``microbatches``, or when 0 the fewest
    that fill the pipeline (pp x stages per rank); 1 without a pipeline."""
    if pp == 1:
        return 1
    return microbatches or pp * stages_per_rank(schedule_spec(schedule), stages_per_rank_asked)


def check_microbatches(spec: ScheduleSpec, *, microbatches: int, pp: int, local_batch: int) -> None:
    """One line for a microbatch count the schedule cannot run, or a batch it cannot split."""
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
    if spec.name in ("1f1b", "interleaved-1f1b", "interleaved-zero-bubble") and microbatches < pp:
        raise ValueError(f"pp_schedule={spec.name} needs at least pp={pp} microbatches to fill the pipeline, got "
                         f"microbatches={microbatches}; pass microbatches >= {pp}")
    rounds = max(1, microbatches // pp)
    if spec.multi and microbatches % rounds:
        raise ValueError(f"pp_schedule={spec.name} runs microbatches in rounds of pp={pp}; {microbatches} is not a "
                         f"multiple of {rounds} rounds: pass a multiple of {pp}")
    if local_batch % microbatches:
        raise ValueError(f"microbatches={microbatches} does not split each data-parallel rank's batch of "
                         f"{local_batch} sequences; make batch / (data-parallel ranks x accum) a multiple of "
                         f"{microbatches}")


def make_schedule(spec: ScheduleSpec, stages: list, *, microbatches: int, loss_fn):
    """The torch schedule over this rank's stages. Grads are not rescaled by torch (``scale_grads=False``):
    the loss is already the global-batch mean's share (zeroshard/parallel/pipeline/runtime.py)."""
    from torch.distributed import pipelining

    cls = getattr(pipelining, spec.torch_class)
    return cls(stages if spec.multi else stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)


def check_compile(spec: ScheduleSpec, compile_arg: object) -> None:
    """Compiled block forwards run under every schedule whose backward is one autograd pass. The
    zero-bubble schedule's input and weight halves are two ``torch.autograd.grad`` calls over the
    stage's graph, which torch does not support for compiled stages (it refuses compiled stage
    modules itself): refused here, by name, before any stage is built."""
    if compile_arg not in (None, False) and spec.split_backward:
        raise ValueError(f"compile is not composed with the {spec.name} schedule (torch splits its backward with "
                         "autograd.grad, which compiled stages do not support); use another pp_schedule or drop "
                         "compile")


def check_checkpointing(spec: ScheduleSpec, checkpointing: str) -> None:
    """Activation checkpointing inside a stage runs under every schedule but the zero-bubble one,
    whose input and weight halves (two ``autograd.grad`` calls) each rebuild the checkpointed
    blocks again: refused there rather than paying those recomputes unplanned."""
    if checkpointing != "none" and spec.split_backward:
        raise ValueError(f"checkpointing={checkpointing!r} is not composed with the {spec.name} schedule (its split "
                         "backward recomputes every block more than once); use another pp_schedule or "
                         "checkpointing none")
