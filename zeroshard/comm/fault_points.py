"""Named fault points: where tests and demos make a run fail on purpose, and how they arm it.

A fault point is a named place in the code (``faults.point("train.step", rank=r, step=s)``) that
does nothing unless its environment variable is set. Each variable holds a spec naming where to
fail (a rank, a step, a unit, a tune candidate); ``configure()`` parses and validates every spec
before a run starts, so a typo is a one-line ``ValueError`` at launch, never a ``KeyError`` in the
middle of a save. The points and their variables:

- ``train.step`` (``ZEROSHARD_FAULT="rank=R,step=S"``): rank R raises at the start of step S
  (1-based, as the progress output counts);
- ``ckpt.write`` (``ZEROSHARD_CKPT_FAULT="rank=R,step=S[,attempt=A]"``): rank R SIGKILLs itself
  halfway through writing its file for the checkpoint of step S, as a node dying mid-save would;
  with ``attempt``, only in that torchrun restart attempt (``TORCHELASTIC_RESTART_COUNT``), so a
  restarted group gets past it;
- ``train.kill`` (``ZEROSHARD_KILL_FAULT="rank=R,step=S[,attempt=A]"``): rank R SIGKILLs itself at the
  start of step S, as a lost node; with ``attempt``, only in that torchrun restart attempt;
- ``tune.build`` (``ZEROSHARD_TUNE_FAULT=NAME``): every rank raises while building the tune
  candidate called NAME, so a failed candidate is reported and the search goes on;
- ``grad.nonfinite`` (``ZEROSHARD_GRAD_FAULT="rank=R,step=S[,unit=U][,count=K]"``): a NaN written into
  rank R's grad shard of unit U (its first unit holding grads by default) at steps S..S+K-1, where
  the non-finite guard first reads the step's grads (zeroshard/runtime/guard.py);
- ``train.spike`` (``ZEROSHARD_SPIKE_FAULT="step=S[,factor=F]"``): the loss of step S reads F times
  (1000 by default) what it was, once per process, for the spike rollback (zeroshard/trainer/heal.py);
- ``comm.unit`` (``ZEROSHARD_COMM_FAULT="kind=K,rank=R,step=S,unit=U[,other=V]"``): a collective
  fault armed on a module of the model, see zeroshard/comm/faults.py for the kinds.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any, Callable, Mapping

COMM_KINDS = ("skip-unit", "raise", "bad-shape", "bad-dtype", "swap-units")


@dataclasses.dataclass(frozen=True)
class Point:
    """One named fault point: its variable, the keys its spec takes, and what it does when hit."""

    env: str
    example: str
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    ints: tuple[str, ...] = ("rank", "step")
    raw: str | None = None  # the spec is a bare value stored under this key (no key=value pairs)
    check: Callable[[dict[str, Any]], str | None] | None = None  # a further rule: the problem, or None


def _check_comm(spec: dict[str, Any]) -> str | None:
    if spec["kind"] not in COMM_KINDS:
        return f"kind={spec['kind']!r} is unknown; use one of {', '.join(COMM_KINDS)}"
    if spec["kind"] == "swap-units" and not spec.get("other"):
        return "kind=swap-units needs other=UNIT (the unit to swap with)"
    return None


POINTS: dict[str, Point] = {
    "train.step": Point(env="ZEROSHARD_FAULT", example="rank=1,step=3", required=("rank", "step")),
    "ckpt.write": Point(env="ZEROSHARD_CKPT_FAULT", example="rank=1,step=4", required=("rank", "step"),
                        optional=("attempt",), ints=("rank", "step", "attempt")),
    "train.kill": Point(env="ZEROSHARD_KILL_FAULT", example="rank=1,step=7,attempt=0", required=("rank", "step"),
                        optional=("attempt",), ints=("rank", "step", "attempt")),
    "tune.build": Point(env="ZEROSHARD_TUNE_FAULT", example="stage3-prefetch1", raw="candidate"),
    "grad.nonfinite": Point(env="ZEROSHARD_GRAD_FAULT", example="rank=1,step=5,unit=blocks.0",
                            required=("rank", "step"), optional=("unit", "count"), ints=("rank", "step", "count")),
    "train.spike": Point(env="ZEROSHARD_SPIKE_FAULT", example="step=8", required=("step",), optional=("factor",),
                         ints=("step",)),
    "comm.unit": Point(env="ZEROSHARD_COMM_FAULT", example="kind=raise,rank=1,step=2,unit=blocks.2",
                       required=("kind", "rank", "step", "unit"), optional=("other",), check=_check_comm),
}

_parsed: dict[tuple[str, str], dict[str, Any]] = {}  # (point, spec) -> the parsed spec; each is parsed once


def env_var(name: str) -> str:
    """The environment variable that arms fault point ``name``."""
    return _point(name).env


def _point(name: str) -> Point:
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; the points are {', '.join(POINTS)}")
    return POINTS[name]


def parse(name: str, spec: str | None) -> dict[str, Any] | None:
    """The spec of fault point ``name`` as a dict (None when unset); a clear ValueError if malformed."""
    point = _point(name)
    if spec is None or not spec.strip():
        return None
    key = (name, spec)
    if key not in _parsed:
        _parsed[key] = _parse(point, spec)
    return dict(_parsed[key])


def _parse(point: Point, spec: str) -> dict[str, Any]:
    def bad(problem: str) -> ValueError:
        return ValueError(f"{point.env}={spec!r} is malformed: {problem}; use e.g. {point.env}='{point.example}'")

    if point.raw is not None:
        return {point.raw: spec.strip()}
    out: dict[str, Any] = {}
    for item in spec.replace(" ", "").split(","):
        k, sep, v = item.partition("=")
        if not sep or not k or not v:
            raise bad(f"{item!r} is not key=value")
        if k not in point.required + point.optional:
            raise bad(f"unknown key {k!r} (it takes {', '.join(point.required + point.optional)})")
        if k in out:
            raise bad(f"key {k!r} is given twice")
        if k in point.ints:
            try:
                out[k] = int(v)
            except ValueError:
                raise bad(f"{k} must be an integer, got {v!r}") from None
        else:
            out[k] = v
    missing = [k for k in point.required if k not in out]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    problem = point.check(out) if point.check is not None else None
    if problem is not None:
        raise bad(problem)
    return out


def armed(name: str, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The spec armed at fault point ``name`` (from the environment), or None."""
    env = os.environ if environ is None else environ
    return parse(name, env.get(_point(name).env))


def configure(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Parse and validate every fault variable that is set; call it before a run starts.

    Returns the armed points; raises a one-line ValueError naming the first malformed variable."""
    armed_now = {name: armed(name, environ) for name in POINTS}
    return {name: spec for name, spec in armed_now.items() if spec is not None}


def point(name: str, **where: Any) -> None:
    """Fault point ``name``: fail here if the armed spec matches ``where`` (rank, step, candidate).

    Off (a dictionary lookup) unless the point's variable is set."""
    spec = armed(name)
    if spec is None:
        return
    if "attempt" in spec:  # the restart attempt torchrun is on (0 outside torchrun)
        where = dict(where, attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    if any(where.get(k) != v for k, v in spec.items()):
        return
    env = POINTS[name].env
    if name in ("ckpt.write", "train.kill"):
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception: as a node dying mid-write
    at = ", ".join(f"{k} {v}" for k, v in where.items())
    raise RuntimeError(f"injected fault ({env}) at {name}: {at}")
