"""Runs that heal: what the loop does after a skipped step or a loss spike.

- Skipped steps: the non-finite guard (zeroshard/runtime/guard.py) skips the update on every rank
  and stops after ``max_bad_steps`` in a row; here its counts go into the run's summary.
- Spike rollback (``rollback_on_spike FACTOR``, opt-in): a step whose global mean loss exceeds FACTOR
  times the mean of the ``rollback_window`` steps before it reloads the newest verified checkpoint
  and passes over the batches from that checkpoint up to the spike, PaLM's recipe. Every rank decides
  alike: the loss is the all-reduced global mean. The skipped batches (their epoch, index and sample
  indices) go to RUN_DIR/rollbacks.jsonl and, through the sampler's state, into every later
  checkpoint; ``skip_from`` gives them to a rerun, which then takes the same steps on the same data.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

from zeroshard.comm import fault_points
from zeroshard.runtime import guard
from zeroshard.runtime.engine import get_engine

ROLLBACKS = "rollbacks.jsonl"
DEFAULT_SPIKE_FACTOR = 1000.0
_fired: set[int] = set()  # spike faults already injected in this process (each fires once)


def injected_spike(loss: float, step: int) -> float:
    """The ``train.spike`` fault point: step ``step``'s loss reads ``factor`` times higher, once."""
    spec = fault_points.armed("train.spike")
    if spec is None or spec["step"] != step or step in _fired:
        return loss
    _fired.add(step)
    return loss * float(spec.get("factor", DEFAULT_SPIKE_FACTOR))


class SpikeWatch:
    """The recent window of losses a spike is measured against (the same on every rank)."""

    def __init__(self, factor: float, window: int) -> None:
        self.factor = factor
        self.losses: collections.deque[float] = collections.deque(maxlen=window)

    def spike(self, loss: float, skipped: bool) -> float | None:
        """The window's mean when ``loss`` is a spike (the window is then left as it was), else None."""
        if not self.factor or skipped or loss != loss:
            return None
        full = len(self.losses) == self.losses.maxlen
        mean = sum(self.losses) / len(self.losses) if self.losses else 0.0
        if full and loss > self.factor * mean:
            return mean
        self.losses.append(loss)
        return None

    def reset(self) -> None:
        self.losses.clear()


def rollback(run: Any, ckpts: Any, obs: Any, step: int, loss: float, mean: float) -> int | None:
    """Roll back from a spike at global step ``step`` (1-based) to the newest verified checkpoint and
    pass over the batches since it (collective). Returns the step to continue after, or None when no
    checkpoint exists yet (the run then goes on, and says so)."""
    ckpts.close()  # an asynchronous save in flight commits first: it may be the newest one
    path = ckpts.newest_verified()
    rank0 = run.mesh.rank == 0
    if path is None:
        if rank0:
            print(f"zeroshard train: loss spike at step {step} ({loss:.4g} vs recent mean {mean:.4g}), but no "
                  "checkpoint was saved yet to roll back to; going on", flush=True)
        return None
    start = ckpts.restore(path)
    skipped = [run.sampler.skip_next() for _ in range(step - start)]
    entry = {"step": step, "loss": loss, "window_mean": mean, "restored_step": start, "checkpoint": str(path),
             "skipped_batches": [[e, i] for e, i, _ in skipped],
             "skipped_samples": [s for _, _, samples in skipped for s in samples]}
    run.rollbacks.append(entry)
    if obs is not None:
        obs.rewind(start)
        if rank0:
            with (obs.run_dir / ROLLBACKS).open("a") as f:
                f.write(json.dumps(entry) + "\n")
    run.records[:] = [r for r in run.records if r.step <= start]
    if rank0:
        print(f"zeroshard train: loss spike at step {step} ({loss:.4g}, {loss / mean:.1f}x the recent mean); "
              f"rolled back to {path} (step {start}) and skipped the {len(skipped)} "
              f"batches after it (RUN_DIR/{ROLLBACKS})", flush=True)
    return start


def load_skips(source: str | Path) -> set[tuple[int, int]]:
    """The skipped batches recorded in a rollbacks.jsonl (or the run dir holding one)."""
    path = Path(source)
    path = path / ROLLBACKS if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"skip_from={str(source)!r}: no {ROLLBACKS} there; name a run dir of a run that rolled back, "
                         "or its rollbacks.jsonl")
    out: set[tuple[int, int]] = set()
    for line in path.read_text().splitlines():
        if line.strip():
            out |= {(int(e), int(i)) for e, i in json.loads(line)["skipped_batches"]}
    return out


def heal_summary(run: Any) -> dict[str, Any]:
    """The summary's record of skipped steps and rollbacks (the guard's counts are the same on every rank)."""
    engines = [get_engine(m) for m in (run.pipeline.modules if run.pipeline is not None else [run.model])]
    report = guard.report(engines[0])
    return {"nonfinite_skipped_steps": report["skipped_steps"], "nonfinite_skips": report["skips"],
            "rollbacks": list(run.rollbacks)}
