"""Learning-rate schedules by the names people know: the Hugging Face Trainer's `lr_scheduler_type`
values and DeepSpeed's scheduler types, one pure function each of the run's [optim] section and the
0-based optimizer step.

`SCHEDULES` is the table the config checks a name against, `zeroshard train --lr-schedule` offers
and the DeepSpeed converter maps a `scheduler.type` into: a schedule added here is known to all three.

The HF formulas are those of `transformers.optimization` (the Trainer's LambdaLR factor at step s,
times `lr`); DeepSpeed's are those of `deepspeed/runtime/lr_schedules.py` at
`last_batch_iteration = s`. Tests hold each one equal, step by step, to `transformers.get_scheduler`
and to DeepSpeed's classes written out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

DEFAULT_SCHEDULE = "warmup_cosine"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One named schedule: its formula, what it is, the warm-up shapes it takes and the [optim]
    keys it reads besides lr, steps and warmup (so the config can say which ones it ignores)."""

    fn: Callable[[Any, int], float]
    what: str
    shapes: tuple[str, ...] = ("linear",)
    reads: tuple[str, ...] = ()
    deepspeed: str | None = None
    """DeepSpeed's scheduler.type for it, where it is one of DeepSpeed's."""


def _warmup_factor(shape: str, step: int, warmup: int) -> float:
    """The climb from 0 to 1 over `warmup` steps, HF's and DeepSpeed's alike at step s (0 at s=0)."""
    progress = step / max(1, warmup)
    if shape == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(1.0 - progress)
    return progress


def warmup_cosine(cfg: Any, step: int) -> float:
    """zeroshard's default: warm-up that reaches lr at its last step (linear lr·(s+1)/warmup, or
    log lr·ln(s+2)/ln(warmup+1)), then a cosine from lr to min_lr that lands on min_lr at the last step."""
    if step < cfg.warmup:
        if cfg.warmup_shape == "log":
            return cfg.lr * math.log(step + 2) / math.log(cfg.warmup + 1)
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- the HF Trainer's


def hf_linear(cfg: Any, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * step / max(1, cfg.warmup)
    return cfg.lr * max(0.0, (cfg.steps - step) / max(1, cfg.steps - cfg.warmup))


def _hf_cosine_factor(cfg: Any, step: int, floor: float) -> float:
    if step < cfg.warmup:
        return step / max(1, cfg.warmup)
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)) * (1 - floor) + floor)


def hf_cosine(cfg: Any, step: int) -> float:
    return cfg.lr * _hf_cosine_factor(cfg, step, 0.0)


def hf_cosine_with_min_lr(cfg: Any, step: int) -> float:
    return cfg.lr * _hf_cosine_factor(cfg, step, cfg.min_lr / cfg.lr)


def hf_constant(cfg: Any, step: int) -> float:
    return cfg.lr


def hf_constant_with_warmup(cfg: Any, step: int) -> float:
    return cfg.lr * step / max(1, cfg.warmup) if step < cfg.warmup else cfg.lr


def hf_polynomial(cfg: Any, step: int) -> float:
    """min_lr is HF's lr_end."""
    if step < cfg.warmup:
        return cfg.lr * step / max(1, cfg.warmup)
    if step > cfg.steps:
        return cfg.min_lr
    remaining = 1 - (step - cfg.warmup) / (cfg.steps - cfg.warmup)
    return (cfg.lr - cfg.min_lr) * remaining ** cfg.power + cfg.min_lr


def decay_steps_of(cfg: Any) -> int:
    """warmup_stable_decay's decay phase: decay_steps, or else decay_ratio of the steps."""
    return cfg.decay_steps if cfg.decay_steps is not None else int(cfg.decay_ratio * cfg.steps)


def hf_warmup_stable_decay(cfg: Any, step: int) -> float:
    """HF's get_wsd_schedule with num_training_steps = steps: warm-up from min_lr, stable at lr,
    then decay (decay_shape) over the last decay steps to min_lr."""
    floor = cfg.min_lr / cfg.lr
    decay = decay_steps_of(cfg)
    stable = cfg.steps - cfg.warmup - decay
    if step < cfg.warmup:
        return cfg.lr * max(0.0, _warmup_factor(cfg.warmup_shape, step, cfg.warmup) * (1.0 - floor) + floor)
    if step < cfg.warmup + stable:
        return cfg.lr
    if step < cfg.warmup + stable + decay:
        progress = (step - cfg.warmup - stable) / max(1, decay)
        factor = {"linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
                  "1-sqrt": 1.0 - math.sqrt(progress)}[cfg.decay_shape]
        return cfg.lr * max(0.0, factor * (1.0 - floor) + floor)
    return cfg.lr * floor


# --------------------------------------------------------------------------- DeepSpeed's


def _ds_gamma(cfg: Any, step: int) -> float | None:
    """WarmupLR's climb (0 to 1), None once warm-up is over. DeepSpeed warms up over at least 2 steps."""
    warmup = max(2, cfg.warmup)
    if step >= warmup:
        return None
    if cfg.warmup_shape == "log":
        return math.log(step + 1) / math.log(warmup)
    return step / warmup


def ds_warmup_lr(cfg: Any, step: int) -> float:
    """From warmup_min_lr to lr over warmup steps, then lr."""
    gamma = _ds_gamma(cfg, step)
    return cfg.warmup_min_lr + (cfg.lr - cfg.warmup_min_lr) * (1.0 if gamma is None else gamma)


def ds_warmup_decay_lr(cfg: Any, step: int) -> float:
    """WarmupLR's climb, then linear decay to warmup_min_lr at the last step (steps = total_num_steps)."""
    gamma = _ds_gamma(cfg, step)
    if gamma is None:
        gamma = max(0.0, (cfg.steps - step) / max(1.0, cfg.steps - max(2, cfg.warmup)))
    return cfg.warmup_min_lr + (cfg.lr - cfg.warmup_min_lr) * gamma


def ds_warmup_cosine_lr(cfg: Any, step: int) -> float:
    """Ratios of lr: from warmup_min_lr/lr up to 1, then a cosine to min_lr/lr (cos_min_ratio)."""
    warmup = max(2, cfg.warmup)
    start, floor = cfg.warmup_min_lr / cfg.lr, cfg.min_lr / cfg.lr
    gamma = _ds_gamma(cfg, step)
    if gamma is not None:
        return cfg.lr * (start + gamma * (1.0 - start))
    progress = min(1.0, (step - warmup + 1) / max(1, cfg.steps - warmup))
    return cfg.lr * max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)


DS_SHAPES = ("log", "linear")
SCHEDULES: dict[str, Schedule] = {
    "warmup_cosine": Schedule(warmup_cosine, "zeroshard's: warm-up reaching lr at its last step, cosine to min_lr "
                              "at the last step", ("linear", "log"), ("min_lr",)),
    "linear": Schedule(hf_linear, "HF: linear warm-up from 0, linear decay to 0"),
    "cosine": Schedule(hf_cosine, "HF: linear warm-up from 0, cosine decay to 0"),
    "cosine_with_min_lr": Schedule(hf_cosine_with_min_lr, "HF: linear warm-up from 0, cosine decay to min_lr",
                                   reads=("min_lr",)),
    "constant": Schedule(hf_constant, "HF: lr at every step (no warm-up)", shapes=()),
    "constant_with_warmup": Schedule(hf_constant_with_warmup, "HF: linear warm-up from 0, then lr"),
    "polynomial": Schedule(hf_polynomial, "HF: linear warm-up from 0, (lr - min_lr)·remaining^power + min_lr",
                           reads=("min_lr", "power")),
    "warmup_stable_decay": Schedule(hf_warmup_stable_decay, "HF: warm-up from min_lr, lr, then decay over "
                                    "decay_steps (or decay_ratio·steps) to min_lr", ("linear", "cosine", "1-sqrt"),
                                    ("min_lr", "decay_steps", "decay_ratio", "decay_shape")),
    "WarmupLR": Schedule(ds_warmup_lr, "DeepSpeed: warm-up from warmup_min_lr (log or linear), then lr", DS_SHAPES,
                         ("warmup_min_lr",), deepspeed="WarmupLR"),
    "WarmupDecayLR": Schedule(ds_warmup_decay_lr, "DeepSpeed: WarmupLR's warm-up, then linear decay to "
                              "warmup_min_lr at the last step", DS_SHAPES, ("warmup_min_lr",), deepspeed="WarmupDecayLR"),
    "WarmupCosineLR": Schedule(ds_warmup_cosine_lr, "DeepSpeed: warm-up from warmup_min_lr, cosine to min_lr",
                               DS_SHAPES, ("warmup_min_lr", "min_lr"), deepspeed="WarmupCosineLR"),
}
WARMUP_SHAPES = tuple(dict.fromkeys(s for sched in SCHEDULES.values() for s in sched.shapes))
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def check_schedule(cfg: Any) -> None:
    """The schedule's own rules, on the [optim] section (ValueError naming the key and the fix)."""
    if cfg.lr_schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule={cfg.lr_schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    sched = SCHEDULES[cfg.lr_schedule]
    if cfg.warmup_shape not in WARMUP_SHAPES:
        raise ValueError(f"warmup_shape={cfg.warmup_shape!r} is invalid; use one of {', '.join(WARMUP_SHAPES)}")
    if sched.shapes and cfg.warmup_shape not in sched.shapes:
        raise ValueError(f"warmup_shape={cfg.warmup_shape!r} is not one lr_schedule={cfg.lr_schedule!r} takes; "
                         f"use one of {', '.join(sched.shapes)}")
    if cfg.decay_shape not in DECAY_SHAPES:
        raise ValueError(f"decay_shape={cfg.decay_shape!r} is invalid; use one of {', '.join(DECAY_SHAPES)}")
    if not 0 <= cfg.warmup_min_lr <= cfg.lr:
        raise ValueError(f"warmup_min_lr={cfg.warmup_min_lr} must lie in [0, lr={cfg.lr}]")
    if cfg.lr_schedule == "polynomial" and cfg.steps <= cfg.warmup:
        raise ValueError(f"lr_schedule='polynomial' decays over steps - warmup = {cfg.steps - cfg.warmup} steps; "
                         "raise steps or lower warmup")
    if cfg.lr_schedule == "warmup_stable_decay" and not 0 <= decay_steps_of(cfg) <= cfg.steps - cfg.warmup:
        raise ValueError(f"warmup_stable_decay decays over {decay_steps_of(cfg)} steps, more than steps - warmup = "
                         f"{cfg.steps - cfg.warmup}; lower decay_steps (or decay_ratio) or warmup")


def lr_of(cfg: Any, step: int) -> float:
    """The learning rate at 0-based optimizer step `step` under `cfg.lr_schedule`."""
    return SCHEDULES[cfg.lr_schedule].fn(cfg, step)
