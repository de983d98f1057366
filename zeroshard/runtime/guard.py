"""The non-finite guard: a step whose loss or global grad norm is not finite is skipped on every rank.

A NaN in one rank's grad shard would otherwise be stepped into that rank's masters (and, reduced,
into every rank's), and every later loss is NaN. The sharded optimizer's ``step`` asks
``should_skip`` first; the answer is one flag every rank agrees on:

- the flag is ``not isfinite(global grad norm)``. ``zs.clip_grad_norm_`` already computes that norm
  and notes it here, so with clipping on the guard adds no collective and no host read the step did
  not make anyway (the step reads the norm on the host to log it). Without clipping the guard does not
  compute the norm (clipping's float64 squares of every chunk): it takes each flat grad buffer's fp32
  norm (``shard_norms``: one ``_foreach_norm``, one read pass, a scalar out per buffer) and calls the
  step good when every one is below ``BOUND``, a 4-byte code max-reduced over the world
  (``norm_code``). That implies the norm is finite; anything else (a non-finite value, a non-finite
  loss, or finite grads too large to tell) is only a suspicion, and the norm itself then decides, so
  the decision is the norm's finiteness bit for bit. An optimizer that takes the flag on the device
  (below) gets the norm itself: the suspicion would need a host read before its update;
- a loop that knows its local loss notes it (``note_loss``): its square's zero multiple is folded
  into the norm's squares, so a non-finite loss on any rank turns the norm non-finite too;
- the norm is summed over the shard group only (replicas and DDP ranks hold identical grads). When
  that group is not the whole world (DDP, hybrid sharding, tp, pp, experts) a value that went bad
  after the reduction on one rank would be seen there alone, so the flag is max-reduced over the
  world, one 4-byte all-reduce, as the fp16 scaler does. With ZeRO over the whole world the norm
  itself is that reduction. The guard's own collectives are recorded under phase ``guard``.

The decision stays on the device when the optimizer can take it there: torch's fused optimizers
(``_step_supports_amp_scaling``, the attribute ``torch.amp.GradScaler`` reads) take the agreed flag
as ``found_inf`` and leave masters, moments and step counts untouched when it is set, bitwise as a
step never taken. The step is then queued without waiting for the flag, and the guard reads it
(with the norm, the same one read) when the grads are zeroed, while the grads the diagnosis reads
still exist: ``settle``. Every reader of the guard's counts settles first. Such a step emits its
``step`` event (the update ran, as a no-op) and the ``skip`` event follows when the flag is read. Any other optimizer
needs the answer before its update, so the flag is read at once, as on the CPU, where a read costs
no wait.

A skipped step is counted, reported to the engine's event stream (``skip``) and diagnosed: every
rank's per-unit squared norms of the grad shards it holds are gathered (once, on the bad step only)
and the first rank and the first unit (in the engine's unit order) holding a non-finite value are
named; rank 0 keeps the report in ``report_dir/nonfinite.json`` (``zeroshard doctor`` reads it). After
``max_bad_steps`` consecutive skips the guard raises ``NonFiniteRunError`` on every rank.

The fault point ``grad.nonfinite`` (``ZEROSHARD_GRAD_FAULT="rank=R,step=S[,unit=U][,count=K]"``,
zeroshard/comm/fault_points.py) writes a NaN into rank R's grad shard of unit U at steps S..S+K-1,
the first time the guard sees the step's grads, in ``zeroshard train`` or a loop of one's own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from zeroshard.comm import collectives, fault_points, host_sync
from zeroshard.comm.names import Group, Phase
from zeroshard.runtime.events import EventKind

REPORT_NAME = "nonfinite.json"


class NonFiniteRunError(RuntimeError):
    """``max_bad_steps`` consecutive steps were skipped for a non-finite loss or grad norm."""


@dataclasses.dataclass
class GuardState:
    """One engine's guard: its settings, what this step noted, and the counts so far."""

    enabled: bool = True
    max_bad_steps: int = 0
    """Consecutive skips after which the run stops; 0 never stops."""
    report_dir: Path | None = None
    norm: torch.Tensor | None = None
    """The global grad norm ``clip_grad_norm_`` computed this step, until the step reads it."""
    loss: torch.Tensor | None = None
    """This rank's loss of this step (``note_loss``), folded into the norm's squares."""
    decided: bool | None = None
    """A decision made for several engines at once (a pipeline rank's stages)."""
    skipped: bool = False
    """Whether the latest step was skipped."""
    skipped_steps: int = 0
    consecutive: int = 0
    first_report: dict[str, Any] | None = None
    """The diagnosis of the first skip of the current run of consecutive skips."""
    reports: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Every skip's diagnosis (step, first rank, first unit), in order."""
    injected_step: int = -1
    norm_value: float | None = None
    """The norm as the guard read it on the host this step, for the step's log (no second read)."""
    pending: torch.Tensor | None = None
    """[bad, norm] of a step whose update took the flag on the device, until ``settle`` reads it."""
    pending_logged: bool = False


_STATES: weakref.WeakKeyDictionary[Any, GuardState] = weakref.WeakKeyDictionary()


def state_of(engine: Any) -> GuardState:
    if engine not in _STATES:
        _STATES[engine] = GuardState()
    return _STATES[engine]


def configure(engine: Any, *, enabled: bool = True, max_bad_steps: int = 0, report_dir: str | Path | None = None) -> None:
    """Turn the guard on or off for ``engine``, and stop after ``max_bad_steps`` consecutive skips."""
    if max_bad_steps < 0:
        raise ValueError(f"max_bad_steps={max_bad_steps} must be >= 0 (0 never stops the run)")
    st = state_of(engine)
    st.enabled, st.max_bad_steps = enabled, max_bad_steps
    st.report_dir = None if report_dir is None else Path(report_dir)


def note_loss(engine: Any, loss: torch.Tensor) -> None:
    """This rank's loss of the step about to be taken (any reduction of it: only finiteness counts)."""
    state_of(engine).loss = loss.detach()


def fold_loss(engine: Any, squares: torch.Tensor) -> None:
    """Add 0 * loss to the local squares: NaN there exactly when the noted loss is not finite."""
    loss = state_of(engine).loss
    if loss is not None:
        squares[0] += loss.to(squares.dtype) * 0.0


def note_norm(engine: Any, norm: torch.Tensor) -> None:
    """The global grad norm of this step (from clipping), for ``should_skip`` to read."""
    state_of(engine).norm = norm


def inject_fault(engine: Any) -> None:
    """The ``grad.nonfinite`` fault point: a NaN in this rank's grad shard of the armed unit."""
    spec = fault_points.armed("grad.nonfinite")
    if spec is None:
        return
    step, rank = collectives.get_ledger().step, engine.mesh.rank
    st = state_of(engine)
    if rank != spec["rank"] or not spec["step"] <= step < spec["step"] + spec.get("count", 1) \
            or st.injected_step == step:
        return
    for group in engine.trainable_groups:
        if group.grad_shard is not None and group.grad_shard.numel() and spec.get("unit", group.unit) == group.unit:
            group.grad_shard.view(-1)[0] = float("nan")
            st.injected_step = step
            return
    raise ValueError(f"{fault_points.env_var('grad.nonfinite')}: rank {rank} holds no grad of unit "
                     f"{spec.get('unit')!r}; name one of {sorted({g.unit for g in engine.trainable_groups})}")


def covers_world(engine: Any) -> bool:
    """Whether the norm's own reduction already spans every rank (ZeRO over the whole world)."""
    mesh = engine.mesh
    return mesh.world == 1 or (engine.policy.shard_optimizer and mesh.shard_size == mesh.world
                               and mesh.tp_size == 1 and mesh.pp_size == 1 and mesh.experts is None)


def flag(engine: Any, norm: torch.Tensor, *, over_world: bool) -> torch.Tensor:
    """[bad, norm] in float32 where the norm is, the same on every rank: the norm's finiteness,
    max-reduced over the world unless the norm's reduction already spanned it."""
    pair = torch.stack([torch.logical_not(torch.isfinite(norm)).to(torch.float32), norm.to(torch.float32)])
    if over_world:  # the norm is the same on every rank, so its max is itself
        collectives.all_reduce(pair, op="max", group=Group.WORLD, phase=Phase.GUARD, mesh=engine.mesh)
    return pair


BOUND = 2.0 ** 64
"""Every buffer's fp32 norm below this means the global norm is finite. Computed plainly in fp32, a
finite buffer norm means no square overflowed, so every |value| < 2^64 and any count of values below
2^48 sums far below fp32's largest square; computed more exactly (a wider accumulator, scaling), the
buffers' squares are below 2^128 each. Either way the float64 norm cannot leave fp32's range."""


def shard_norms(engine: Any) -> torch.Tensor:
    """The largest fp32 norm of this rank's grad buffers (0 without any) on the mesh's device, NaN
    when the noted loss is not finite (its zero multiple is added): one ``_foreach_norm`` per device,
    no copy, where the global norm squares a float64 copy of every chunk."""
    device = engine.mesh.device
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for group in engine.trainable_groups:
        grad = group.grad_shard
        if grad is not None and grad.numel():
            by_device.setdefault(grad.device, []).append(grad)
    peak: torch.Tensor | None = None if device in by_device else torch.zeros((), dtype=torch.float32, device=device)
    for where in sorted(by_device, key=lambda d: d != device):  # the mesh's device first
        norms = torch._foreach_norm(by_device[where], 2, dtype=torch.float32)  # noqa: SLF001 (no public foreach norm)
        here = norms[0] if len(norms) == 1 else torch.stack(norms).amax()  # amax propagates NaN
        # An offloaded (host) shard's norm joins as a host scalar: no blocking copy to the device.
        peak = here if peak is None else torch.maximum(peak, here)
    assert peak is not None  # the mesh's device was first, or the zeros
    loss = state_of(engine).loss
    return peak if loss is None else peak + loss.to(torch.float32) * 0.0


def norm_code(engine: Any) -> torch.Tensor:
    """[suspect, suspect] in float32, the same on every rank: 1 where some rank's ``shard_norms`` is
    not below ``BOUND`` (NaN included), max-reduced over the world (one 4-byte all-reduce; a code,
    because a backend's max need not propagate NaN), else 0. The pair's shape is ``flag``'s."""
    code = torch.logical_not(shard_norms(engine) < BOUND).to(torch.float32).reshape(1)
    if engine.mesh.world > 1:
        collectives.all_reduce(code, op="max", group=Group.WORLD, phase=Phase.GUARD, mesh=engine.mesh)
    return torch.cat([code, code])


def read(engine: Any, pair: torch.Tensor, *, logged: bool) -> bool:
    """The flag on the host: one read, which also reads the norm itself, so a step that logs its
    norm (``logged``: clipping computed it) takes it from ``norm_value`` instead of reading it again."""
    bad, value = host_sync.tolist(pair, "step.grad_norm" if logged else "guard.nonfinite", fake_value=[0.0, 0.0])
    state_of(engine).norm_value = float(value) if logged else None  # unlogged: no norm to log, or no norm
    return bool(bad)


def agree(engine: Any, norm: torch.Tensor, *, over_world: bool, logged: bool) -> bool:
    """Whether the step is bad, the same on every rank (``flag``), read on the host (``read``)."""
    return read(engine, flag(engine, norm, over_world=over_world), logged=logged)


def takes_flag(optimizer: Any) -> bool:
    """Whether ``optimizer``'s update takes the flag on the device (``found_inf``): torch's fused
    optimizers, which skip the update of a step whose flag is set, step counts included."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def settle(engine: Any) -> None:
    """Read the flag of a step whose update took it on the device, and count, diagnose and report
    it as ``should_skip`` does at once elsewhere (collective on a bad step, which every rank sees
    alike). Call it before the step's grads are zeroed; a no-op when nothing is pending."""
    st = state_of(engine)
    if st.pending is None:
        return
    pair, st.pending = st.pending, None
    record(engine, read(engine, pair, logged=st.pending_logged))


def norm_value(engine: Any) -> float | None:
    """The grad norm the guard read on the host for the step just taken (once; a step that clipped),
    else None."""
    settle(engine)
    st = state_of(engine)
    value, st.norm_value = st.norm_value, None
    return value


def should_skip(engine: Any, norm_of: Callable[[Any], torch.Tensor], optimizer: Any = None) -> bool:
    """Called by the sharded optimizer's step (collective unless clipping noted the norm over the
    whole world): True when every rank must skip this step. Raises ``NonFiniteRunError`` after
    ``max_bad_steps`` consecutive skips. ``norm_of(engine)``: the global grad norm, computed as
    clipping computes it, for a step that did not clip, when ``norm_code`` suspects it or ``optimizer``
    takes the flag on the device (``clip.guard_norm``; passed in because clipping notes its norm here). When
    ``optimizer`` takes the flag on the device (``takes_flag``) it is set as its ``found_inf`` and
    False returned: the update skips itself, and ``settle`` reads the flag later; the caller
    deletes ``found_inf`` after the update."""
    st = state_of(engine)
    if not st.enabled:
        return False
    settle(engine)  # a previous step's flag nobody read (its grads were never zeroed)
    if st.decided is not None:
        bad = st.decided
    else:
        logged, on_device = st.norm is not None, optimizer is not None and takes_flag(optimizer)
        if st.norm is not None:
            pair = flag(engine, st.norm, over_world=not covers_world(engine))
        else:  # no clipping this step
            inject_fault(engine)
            pair = flag(engine, norm_of(engine), over_world=not covers_world(engine)) if on_device \
                else norm_code(engine)
        if on_device:
            st.norm, st.loss, st.pending, st.pending_logged = None, None, pair, logged
            optimizer.found_inf = pair[0]
            return False
        bad = read(engine, pair, logged=logged)
        if bad and not logged:  # a suspicion (``norm_code``): the norm itself decides
            bad = agree(engine, norm_of(engine), over_world=not covers_world(engine), logged=False)
    st.norm, st.loss, st.decided = None, None, None
    record(engine, bad)
    return bad


def skipped(engine: Any) -> bool:
    """Whether the guard skipped the step just taken (the same on every rank)."""
    settle(engine)
    return state_of(engine).skipped


def decide_for(engines: list[Any], norm: torch.Tensor) -> bool:
    """One decision for several engines of this rank (a pipeline rank's stages), from their joint
    norm; each engine's ``should_skip`` then returns it without a collective of its own."""
    bad = agree(engines[0], norm, over_world=True, logged=True)
    for engine in engines:
        st = state_of(engine)
        st.norm, st.loss, st.decided = None, None, bad if st.enabled else None
    return bad


def record(engine: Any, bad: bool) -> None:
    st = state_of(engine)
    st.skipped = bad
    if not bad:
        st.consecutive, st.first_report = 0, None
        return
    st.skipped_steps += 1
    st.consecutive += 1
    report = diagnose(engine)
    st.reports.append(report)
    if st.first_report is None:
        st.first_report = report
    if engine.events.active:
        engine.events.emit(EventKind.SKIP, report.get("first_unit") or "", "step", 0)
    stop = bool(st.max_bad_steps and st.consecutive >= st.max_bad_steps)
    path = write_report(engine, st, stopped=stop)  # after every skip: a run killed later still tells where
    if stop:
        raise NonFiniteRunError(stop_message(st, path))


def diagnose(engine: Any) -> dict[str, Any]:
    """Which ranks hold non-finite grads, in which units: every rank's per-unit squared norms of its
    grad shards, gathered over the world (collective; only on a bad step, which every rank agrees on)."""
    units = [u.name for u in engine.units]
    local = torch.zeros(len(units), dtype=torch.float64, device=engine.mesh.device)
    for i, unit in enumerate(engine.units):
        for group in unit.groups:
            if group.trainable and group.grad_shard is not None and group.grad_shard.numel():
                local[i] += group.grad_shard.detach().to(torch.float64).square().sum()
    world = engine.mesh.world
    every = torch.empty(world * len(units), dtype=torch.float64, device=local.device)
    collectives.all_gather(every, local, group=Group.WORLD, phase=Phase.GUARD, mesh=engine.mesh)
    rows = host_sync.tolist(every.reshape(world, len(units)), "guard.diagnose")
    bad = [(r, units[i]) for r in range(world) for i in range(len(units)) if not math.isfinite(rows[r][i])]
    first_rank = bad[0][0] if bad else None
    first_unit = next((u for u in units if (first_rank, u) in bad), None)
    return {"step": collectives.get_ledger().step, "first_rank": first_rank, "first_unit": first_unit,
            "nonfinite": [{"rank": r, "unit": u} for r, u in bad],
            "unit_norms": None if first_rank is None else
            {u: math.sqrt(v) if math.isfinite(v) else str(v) for u, v in zip(units, rows[first_rank])},
            "cause": "grads" if bad else "loss (the grads this step left were finite)"}


def stop_message(st: GuardState, path: Path | None) -> str:
    first = st.first_report or {}
    where = (f"rank {first['first_rank']}, unit {first['first_unit']}" if first.get("first_rank") is not None
             else "a non-finite loss")
    return (f"{st.consecutive} consecutive steps had a non-finite loss or grad norm and were skipped "
            f"(the first at step {first.get('step')}, {where}); stopping"
            + (f"; report in {path}" if path is not None else ""))


def report(engine: Any, *, stopped: bool = False) -> dict[str, Any]:
    """What the guard saw: skipped steps, the current run of skips and where it started, and whether
    it stopped the run."""
    settle(engine)
    st = state_of(engine)
    return {"skipped_steps": st.skipped_steps, "consecutive": st.consecutive, "max_bad_steps": st.max_bad_steps,
            "stopped": stopped, "first": st.first_report, "skips": st.reports}


def write_report(engine: Any, st: GuardState, *, stopped: bool) -> Path | None:
    """``report_dir/nonfinite.json`` (rank 0 writes it; the path on every rank), or None without a dir."""
    if st.report_dir is None:
        return None
    path = st.report_dir / REPORT_NAME
    if engine.mesh.rank == 0:
        st.report_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report(engine, stopped=stopped), indent=2) + "\n")
    return path
