"""Every named schedule equal, step by step, to its owner's: transformers' own scheduler functions for
the HF Trainer's names, DeepSpeed's classes (deepspeed/runtime/lr_schedules.py, written out below, as
DeepSpeed is not installed) for DeepSpeed's."""

from __future__ import annotations

import math

import pytest
import torch

from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.schedules import SCHEDULES
from zeroshard.trainer.step import lr_at, make_scheduler

transformers = pytest.importorskip("transformers")

LR, MIN_LR, STEPS = 3e-4, 2e-5, 40


def _hf_lrs(name: str, warmup: int, **kwargs) -> list[float]:
    """What the HF Trainer's LambdaLR gives at each optimizer step (lr read before each step)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = transformers.get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=STEPS,
                                       scheduler_specific_kwargs=kwargs or None)
    out = []
    for _ in range(STEPS + 3):  # past the end too: the schedules say what happens there
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


HF_CASES = [  # (name, warmup, zeroshard keys, the same in HF's scheduler_specific_kwargs)
    ("linear", 7, {}, {}),
    ("linear", 0, {}, {}),
    ("cosine", 7, {}, {}),
    ("cosine_with_min_lr", 5, {"min_lr": MIN_LR}, {"min_lr": MIN_LR}),
    ("constant", 0, {}, {}),
    ("constant_with_warmup", 9, {}, {}),
    ("polynomial", 6, {"min_lr": MIN_LR, "power": 2.0}, {"lr_end": MIN_LR, "power": 2.0}),
    ("polynomial", 6, {"min_lr": 1e-7}, {}),
    ("warmup_stable_decay", 6, {"decay_steps": 10, "min_lr": MIN_LR},
     {"num_decay_steps": 10, "min_lr_ratio": MIN_LR / LR}),
    ("warmup_stable_decay", 4, {"decay_steps": 12, "min_lr": 0.0, "warmup_shape": "1-sqrt", "decay_shape": "linear"},
     {"num_decay_steps": 12, "warmup_type": "1-sqrt", "decay_type": "linear"}),
    ("warmup_stable_decay", 4, {"decay_ratio": 0.25, "min_lr": 0.0, "warmup_shape": "cosine",
                                "decay_shape": "1-sqrt"},
     {"num_decay_steps": 10, "warmup_type": "cosine", "decay_type": "1-sqrt"}),
]


@pytest.mark.parametrize("name,warmup,ours,theirs", HF_CASES, ids=lambda v: str(v) if isinstance(v, (str, int)) else "")
def test_hf_schedules_equal_transformers(name, warmup, ours, theirs):
    cfg = TrainConfig(lr=LR, steps=STEPS, warmup=warmup, lr_schedule=name, **{"min_lr": 0.0, **ours})
    expected = _hf_lrs(name, warmup, **theirs)
    got = [lr_at(cfg, s) for s in range(len(expected))]
    assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-15 * LR * 10, (name, got, expected)


# --- DeepSpeed 0.19's lr_schedules.py, the three classes' get_lr at last_batch_iteration = s -----------


def _ds_gamma(s: int, warmup_num_steps: int, warmup_type: str) -> float | None:
    w = max(2, warmup_num_steps)
    if s < w:
        return (1.0 / math.log(w)) * math.log(s + 1) if warmup_type == "log" else s / w
    return None


def ds_warmup_lr(s, *, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type):
    gamma = _ds_gamma(s, warmup_num_steps, warmup_type)
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * (1.0 if gamma is None else gamma)


def ds_warmup_decay_lr(s, *, total_num_steps, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type):
    gamma = _ds_gamma(s, warmup_num_steps, warmup_type)
    if gamma is None:
        gamma = max(0.0, float(total_num_steps - s) / float(max(1.0, total_num_steps - max(2, warmup_num_steps))))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def ds_warmup_cosine_lr(s, *, lr, total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type):
    w = max(2, warmup_num_steps)
    if s < w:
        ratio = (1.0 / math.log(w)) * math.log(s + 1) if warmup_type == "log" else s / w
        return lr * (warmup_min_ratio + ratio * (1.0 - warmup_min_ratio))
    progress = min(1.0, (s - w + 1) / max(1, total_num_steps - w))
    return lr * max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


@pytest.mark.parametrize("shape", ["log", "linear"])
@pytest.mark.parametrize("warmup", [1, 8])
def test_deepspeed_schedules_equal_their_formulas(shape, warmup):
    low = 1e-5
    steps = range(STEPS + 3)
    cfg = dict(lr=LR, steps=STEPS, warmup=warmup, warmup_shape=shape, warmup_min_lr=low, min_lr=LR * 0.05)
    cases = {
        "WarmupLR": [ds_warmup_lr(s, warmup_min_lr=low, warmup_max_lr=LR, warmup_num_steps=warmup, warmup_type=shape)
                     for s in steps],
        "WarmupDecayLR": [ds_warmup_decay_lr(s, total_num_steps=STEPS, warmup_min_lr=low, warmup_max_lr=LR,
                                             warmup_num_steps=warmup, warmup_type=shape) for s in steps],
        "WarmupCosineLR": [ds_warmup_cosine_lr(s, lr=LR, total_num_steps=STEPS, warmup_min_ratio=low / LR,
                                               warmup_num_steps=warmup, cos_min_ratio=0.05, warmup_type=shape)
                           for s in steps],
    }
    for name, expected in cases.items():
        got = [lr_at(TrainConfig(lr_schedule=name, **cfg), s) for s in steps]
        assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-18, (name, got, expected)


def test_every_schedule_is_tested_and_drives_the_optimizer():
    tested = {c[0] for c in HF_CASES} | {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "warmup_cosine"}
    assert tested == set(SCHEDULES)
    cfg = TrainConfig(lr=LR, steps=12, warmup=3, lr_schedule="WarmupDecayLR", warmup_shape="linear")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = make_scheduler(cfg, opt)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(cfg, s) for s in range(12)], rel=1e-12, abs=1e-20)


@pytest.mark.parametrize("kwargs,message", [
    ({"lr_schedule": "cosine_annealing"}, "lr_schedule='cosine_annealing' is unknown; use one of warmup_cosine, linear"),
    ({"lr_schedule": "linear", "warmup_shape": "log"}, "warmup_shape='log' is not one lr_schedule='linear' takes"),
    ({"lr_schedule": "warmup_stable_decay", "steps": 10, "warmup": 5, "decay_steps": 8},
     "warmup_stable_decay decays over 8 steps, more than steps - warmup = 5"),
    ({"decay_shape": "step"}, "decay_shape='step' is invalid"),
    ({"lr_schedule": "WarmupLR", "warmup_min_lr": 1.0}, "warmup_min_lr=1.0 must lie in"),
])
def test_schedule_mistakes_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kwargs)
