"""Experiment loggers: TensorBoard and Weights & Biases get the scalars that metrics.jsonl holds.

Each step's record is the one written to metrics.jsonl; `scalars` picks the same numbers out of it
(loss, lr, grad norm, tokens/s, MFU, memory, comm bytes, exposed comm time), so the loggers can never
disagree with the file. Only rank 0 logs. Both packages are optional (`pip install 'zeroshard[log]'`)
and are imported only when asked for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Protocol

LOGGERS = ("tensorboard", "wandb")
EXTRA = "pip install 'zeroshard[log]'"

SCALARS: dict[str, tuple[str, ...]] = {
    "train/loss": ("loss",),
    "train/lr": ("lr",),
    "train/grad_norm": ("grad_norm",),
    "train/loss_scale": ("loss_scale",),
    "eval/loss": ("eval_loss",),
    "eval/perplexity": ("eval_perplexity",),
    "perf/step_time_s": ("step_time_s",),
    "perf/tokens_per_s": ("tokens_per_s",),
    "perf/mfu": ("profile", "mfu"),
    "memory/peak_mb": ("profile", "mem_peak_mb"),
    "comm/bytes": ("profile", "comm_bytes"),
    "comm/exposed_s": ("profile", "comm_exposed_s"),
    "comm/overlap": ("profile", "overlap"),
}
"""Logged name -> where the value sits in a metrics.jsonl record."""


def parse_log(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` (or a sequence of names) -> the names, checked; () for none."""
    if value is None:
        return ()
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value)]
    names = [n for n in names if n and n != "none"]
    for name in names:
        if name not in LOGGERS:
            raise ValueError(f"unknown logger {name!r}: choose from {', '.join(LOGGERS)} (comma-separated)")
    return tuple(dict.fromkeys(names))


def check_installed(names: Iterable[str]) -> None:
    """A one-line error naming the extra to install when a logger's package is missing."""
    for name in names:
        try:
            if name == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            else:
                import wandb  # noqa: F401
        except ImportError:
            raise ValueError(f"log={name!r} needs the {name} package, which is not installed: {EXTRA}") from None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The loggable numbers of one metrics.jsonl record, plus any extra top-level numbers the loop passed."""
    out: dict[str, float] = {}
    for name, path in SCALARS.items():
        value: Any = record
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    known = {path[0] for path in SCALARS.values()} | {"step", "tokens"}
    for key, value in record.items():  # the loop's own numbers, passed to Observer.step by name
        if key not in known and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"train/{key}"] = float(value)
    return out


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """Event files under RUN_DIR/tensorboard (``tensorboard --logdir RUN_DIR/tensorboard``)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a crashed run keeps its curves, as it keeps metrics.jsonl

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in RUN_DIR (WANDB_DIR wins); WANDB_MODE=offline keeps it local, WANDB_PROJECT names it."""

    def __init__(self, run_dir: Path, config: dict[str, Any] | None) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "zeroshard"), name=run_dir.name,
                              dir=os.environ.get("WANDB_DIR", str(run_dir)), config=config or {})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(names: Iterable[str], run_dir: Path, config: dict[str, Any] | None) -> list[Sink]:
    check_installed(names)
    sinks: list[Sink] = []
    for name in names:
        sinks.append(TensorBoardSink(run_dir) if name == "tensorboard" else WandbSink(run_dir, config))
    return sinks
