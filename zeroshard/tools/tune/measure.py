"""Time a few real training steps of every candidate on N spawned ranks, interleaved.

Rounds run A B C ... A B C ... so the slow drift of a shared machine lands on every candidate
alike. Each timed step starts after a barrier, and a step lasts as long as its slowest rank. Peak
memory is measured over one separate, untimed step (tracking costs time) as the peak of live
tensor storage, which is what the planner's *allocated* figure predicts.

A candidate that raises (an OOM, a combination the runtime refuses) is dropped on every rank and
reported; the others go on. The ranks agree on that after each candidate's turn, so a failure
that strikes every rank alike is never fatal. One that strands a peer inside a collective ends the
whole measurement when the process-group timeout (``hang_timeout_s``) fires.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import statistics
import warnings
from typing import Any

from zeroshard.comm import fault_points as faults
from zeroshard.tools.harness import timed
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.step import slowest_per_step
from zeroshard.tools.tune.grid import Candidate
from zeroshard.tools.tune.prune import Prediction, vocab_size

FAULT_ENV = faults.env_var("tune.build")
"""For tests: a candidate name (as printed) whose build raises on every rank."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasureSpec:
    base: TrainConfig
    """The workload: model, world (nproc), global batch, seq_len, precision, accum, clip, optimizer."""
    candidates: tuple[Candidate, ...]
    steps: int = 3
    """Timed steps per candidate in each round."""
    rounds: int = 3
    warmup: int = 2
    """Untimed steps after a build: optimizer state is created and stage 3 learns its unit order."""
    resident: bool = True
    """Keep every candidate built across rounds; False rebuilds each in its turn (less memory, the
    warm-up paid every round)."""

    def __post_init__(self) -> None:
        for name in ("steps", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")


def fits_resident(predictions: list[Prediction], *, world: int, limit: int, shared_host: bool) -> bool:
    """Whether every candidate can stay built at once. Local CPU ranks share one host's memory."""
    need = sum(p.allocated for p in predictions) * (world if shared_host else 1)
    return need <= limit


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


# --------------------------------------------------------------------------- one candidate, on one rank


class _Built:
    """A candidate built and stepped exactly as `zeroshard train` builds and steps it
    (zeroshard/trainer/step.py): every sharding option of the config, offload and the model's own shard
    arguments included, so tune never ranks a set-up that train would run differently."""

    def __init__(self, cfg: TrainConfig, mesh: Any) -> None:
        from zeroshard.trainer import step
        self.run = step.build(cfg, mesh)
        self.model, self.opt = self.run.model, self.run.opt

    def step(self, x, y, tracker: Any = None) -> None:
        from zeroshard.trainer import step
        if self.run.pipeline is not None:  # torch's schedule runs the microbatches: no per-micro hook
            step.step(self.run, x, y)
            return

        def micro(index: int) -> contextlib.AbstractContextManager[None]:
            if index and tracker is not None:
                tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise
            return contextlib.nullcontext()

        step.step(self.run, x, y, micro=micro)

    def externals(self, x, y) -> list:
        from zeroshard.runtime import get_engine

        groups = get_engine(self.model).groups
        buffers = [t for g in groups for t in (g.full, g.shard, g.grad_full, g.grad_shard) if t is not None]
        return [self.model, self.opt, x, y, *buffers]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_bytes(built: _Built, x, y, device: Any) -> int | None:
    """Peak live tensor storage over one step: the engine's flat buffers, the optimizer's state, and
    everything the step allocates. Stage 3's shards live in the engine, not the module, hence
    tracking its buffers explicitly (as the planner's own --measure does). None under a pipeline:
    its peak per pp rank is `plan --pp --measure`'s (every stage's engine tracked), not read here."""
    if built.run.pipeline is not None:
        return None
    from zeroshard.tools.planner.mem_tracker import memory_tracker

    tracker = memory_tracker()  # a frozen param (an adapter's base, a model's own frozen bias) taken
    tracker.track_external(*built.externals(x, y))
    with tracker, warnings.catch_warnings():
        # Stages 2-3 move each grad into the engine's flat buffer and leave param.grad None; the
        # tracker warns on that and skips it, which is right: the buffer is tracked already.
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        built.step(x, y, tracker)
        _sync(device)
    return int(max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values()))


# --------------------------------------------------------------------------- every candidate, on one rank


def _expert_meshes(spec: MeasureSpec, default: Any) -> dict[int, Any]:
    """A mesh for every ep degree the candidates run at: the default one (at the base config's ep)
    and, for each other degree, a ``zs.new_mesh`` over the same ranks with that ep dim, so one spawn
    measures every degree. Built on every rank in the same order (new_mesh is collective)."""
    from zeroshard.comm.world import new_mesh as zs_new_mesh

    meshes = {spec.base.ep: default}
    for ep in sorted({c.ep for c in spec.candidates if c.ep is not None} - {spec.base.ep}):
        meshes[ep] = zs_new_mesh(name=f"tune_ep{ep}", tp=spec.base.tp, pp=spec.base.pp, ep=ep)
    return meshes


def rank_main(spec: MeasureSpec) -> list[dict]:
    """Spawn target. Returns, per candidate in spec order, this rank's times, peak and error."""
    import torch

    from zeroshard.comm.mesh import shutdown
    from zeroshard.comm.world import init
    from zeroshard.comm.collectives import all_gather_object

    base = spec.base
    mesh = init(timeout_s=base.hang_timeout_s, tp=base.tp, pp=base.pp, ep=base.ep)
    meshes = _expert_meshes(spec, mesh)
    torch.set_num_threads(1)  # one core per rank: ranks must not fight over threads
    # The ranks of one tp group compute on the same batch (their matmuls are split, not their data).
    gen = torch.Generator().manual_seed(base.seed + mesh.dp_rank)
    shape = (base.batch // mesh.dp_size, base.seq_len)
    x = torch.randint(0, vocab_size(base), shape, generator=gen).to(mesh.device)
    y = torch.randint(0, vocab_size(base), shape, generator=gen).to(mesh.device)
    out: list[dict[str, Any]] = [{"times": [], "peak_bytes": None, "error": None} for _ in spec.candidates]
    built: dict[int, _Built] = {}
    for _ in range(spec.rounds):
        for i, cand in enumerate(spec.candidates):
            if out[i]["error"] is not None:
                continue
            error = None
            try:
                if i not in built:
                    faults.point("tune.build", candidate=cand.name)
                    cfg = base.replace(**cand.train_keys())
                    built[i] = _Built(cfg, meshes[cfg.ep])
                    for _ in range(spec.warmup):
                        built[i].step(x, y)
                    if out[i]["peak_bytes"] is None:
                        out[i]["peak_bytes"] = _peak_bytes(built[i], x, y, mesh.device)
                out[i]["times"] += timed(functools.partial(built[i].step, x, y), spec.steps, phase="tune",
                                         device=mesh.device)
            except Exception as e:  # noqa: BLE001 - a failed candidate is a result, not the end
                error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            errors = all_gather_object(error, phase="tune")
            failed = [(rank, err) for rank, err in enumerate(errors) if err is not None]
            if failed:
                same = len(failed) == mesh.world and len({err for _, err in failed}) == 1
                out[i]["error"] = (f"every rank: {failed[0][1]}" if same
                                   else "; ".join(f"rank {rank}: {err}" for rank, err in failed[:2]))
            if failed or not spec.resident:
                built.pop(i, None)
                gc.collect()  # free this candidate before the next is built
    shutdown()
    return out


# --------------------------------------------------------------------------- the ranks together


def summarise(spec: MeasureSpec, per_rank: list[list[dict]]) -> list[dict]:
    """One row per candidate, in spec order. A step is as slow as its slowest rank; the peak is the
    worst rank's."""
    tokens = spec.base.batch * spec.base.seq_len
    rows = []
    for i, cand in enumerate(spec.candidates):
        row: dict[str, Any] = {"candidate": cand.name, **cand.train_keys()}
        errors = [r[i]["error"] for r in per_rank if r[i]["error"]]
        if errors:
            rows.append({**row, "status": "failed", "error": errors[0]})
            continue
        steps = slowest_per_step([r[i]["times"] for r in per_rank])
        median = statistics.median(steps)
        q = statistics.quantiles(steps, n=4) if len(steps) >= 2 else [median, median, median]
        rows.append({**row, "status": "ok", "tokens_per_s": tokens / median if median > 0 else math.inf,
                     "median_step_s": median, "spread": (q[2] - q[0]) / median if median > 0 else 0.0,
                     "timed_steps": len(steps), "measured_peak_bytes": max((r[i]["peak_bytes"] for r in per_rank
                                                                    if r[i]["peak_bytes"] is not None), default=None)})
    return rows


def measure(spec: MeasureSpec, *, timeout_s: float = 3600.0) -> list[dict]:
    """Run every candidate of ``spec`` on ``spec.base.nproc`` local ranks; rows in spec order."""
    from zeroshard.trainer.launch import spawn

    faults.configure()  # a malformed fault variable fails here, not in every rank
    return summarise(spec, spawn(rank_main, spec.base.nproc, args=(spec,), timeout_s=timeout_s))
