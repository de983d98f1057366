"""The training loop, made of small functions, run identically on every rank.

`train_worker(cfg)` is the entry point: the CLI passes it to `zeroshard.launch.spawn` for local
runs, or calls it directly under torchrun. It joins the process group, builds the same model on
every rank (same seed, so no broadcast is needed), shards it, and runs `cfg.steps` optimizer
steps over the GLOBAL batch, of which each rank takes its contiguous slice.

`reference_train(cfg)` is the plain single-process PyTorch loop that `zeroshard verify`
compares against: no zeroshard runtime, the same model, data, schedule and clipping.

Rank 0 reports through a `Reporter` (the CLI supplies a rich one) and writes
`RUN_DIR/metrics.jsonl` (one object per step, flushed as it goes, so a crashed run keeps its
history) and `RUN_DIR/config.json`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

import zeroshard as zs
from zeroshard.comm.collectives import all_reduce
from zeroshard.config import TrainConfig, check_batch_split
from zeroshard.data import GlobalBatchSampler, build_dataset, collate
from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.sharding.precision import parse_dtype

FAULT_ENV = "ZEROSHARD_FAULT"
"""Fault injection for tests: "rank=1,step=3" makes rank 1 raise at the start of step 3
(1-based, as printed)."""

BETAS = (0.9, 0.95)
METRICS_PHASE = "metrics"


class Reporter(Protocol):
    """What rank 0 shows while training; the loop itself knows nothing about terminals."""

    def start(self, info: dict[str, Any]) -> None: ...
    def step(self, rec: StepRecord) -> None: ...
    def finish(self, summary: dict[str, Any]) -> None: ...


class NullReporter:
    def start(self, info: dict[str, Any]) -> None:
        pass

    def step(self, rec: StepRecord) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


@dataclass(kw_only=True)
class StepRecord:
    """One optimizer step, as written to metrics.jsonl."""

    step: int
    loss: float
    lr: float
    grad_norm: float | None
    step_time_s: float
    tokens: int
    tokens_per_s: float


@dataclass(kw_only=True)
class Run:
    """Everything one rank holds for a run."""

    cfg: TrainConfig
    mesh: Any
    model: torch.nn.Module
    opt: Any
    dataset: Any
    sampler: GlobalBatchSampler
    model_cfg: GPTConfig
    num_params: int
    """Counted before sharding: at stage 3 the modules hold only this rank's slices."""
    records: list[StepRecord] = field(default_factory=list)
    metric_bytes: int = 0
    """Bytes of our own metric all-reduces, kept apart from the training traffic."""


# --------------------------------------------------------------------------- schedule and faults


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr` at the last step. `step` is 0-based."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - 1 - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(param_groups: list[dict[str, Any]], lr: float) -> None:
    for group in param_groups:
        group["lr"] = lr


def parse_fault(spec: str | None) -> tuple[int, int] | None:
    """Parse ZEROSHARD_FAULT="rank=R,step=S" into (R, S)."""
    if not spec:
        return None
    try:
        parts = dict(kv.split("=", 1) for kv in spec.replace(" ", "").split(","))
        return int(parts["rank"]), int(parts["step"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"{FAULT_ENV}={spec!r} is malformed; use e.g. 'rank=1,step=3'") from e


def maybe_inject_fault(rank: int, step: int) -> None:
    fault = parse_fault(os.environ.get(FAULT_ENV))
    if fault is not None and fault == (rank, step):
        raise RuntimeError(f"injected fault ({FAULT_ENV}) on rank {rank} at step {step}")


# --------------------------------------------------------------------------- building


def build_data(cfg: TrainConfig) -> Any:
    return build_dataset(
        data_path=cfg.data, seq_len=cfg.seq_len, num_samples=cfg.num_samples,
        vocab_size=cfg.vocab_size, order=cfg.order, seed=cfg.seed,
    )


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device) -> GPT:
    """Seed first, so every rank (and the single-process reference) starts bit-identical."""
    model_cfg = GPTConfig.named(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len)
    torch.manual_seed(cfg.seed)
    return GPT(model_cfg).to(device)


def mixed_precision(cfg: TrainConfig) -> zs.MixedPrecision | None:
    return None if cfg.param_dtype == "fp32" else zs.MixedPrecision(param_dtype=parse_dtype(cfg.param_dtype))


def setup(cfg: TrainConfig, mesh: Any) -> Run:
    check_batch_split(cfg.batch, mesh.world)
    dataset = build_data(cfg)
    model = build_model(cfg, dataset.vocab_size, mesh.device)
    num_params = model.num_params()
    zs.shard(model, stage=cfg.stage, mp=mixed_precision(cfg), bucket_mb=cfg.bucket_mb)
    opt = zs.optimizer(
        model, torch.optim.AdamW, lr=lr_at(cfg, 0), weight_decay=cfg.weight_decay, betas=BETAS
    )
    sampler = GlobalBatchSampler(
        len(dataset), cfg.batch, world=mesh.world, rank=mesh.rank, seed=cfg.seed
    )
    return Run(
        cfg=cfg, mesh=mesh, model=model, opt=opt, dataset=dataset, sampler=sampler,
        model_cfg=model.cfg, num_params=num_params,
    )


# --------------------------------------------------------------------------- the loop


def average_across_ranks(run: Run, value: torch.Tensor) -> float:
    t = value.detach().float().reshape(1).clone()
    all_reduce(t, op="avg", phase=METRICS_PHASE)
    run.metric_bytes += t.numel() * t.element_size()
    return float(t.item())


def max_across_ranks(run: Run, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float32, device=run.mesh.device)
    all_reduce(t, op="max", phase=METRICS_PHASE)
    run.metric_bytes += t.numel() * t.element_size()
    return float(t.item())


def train_step(run: Run, step: int) -> StepRecord:
    """One optimizer step on this rank's slice of the global batch."""
    cfg = run.cfg
    t0 = time.perf_counter()
    maybe_inject_fault(run.mesh.rank, step + 1)  # 1-based, as the progress output counts
    lr = lr_at(cfg, step)
    set_lr(run.opt.param_groups, lr)
    x, y = collate(run.dataset, run.sampler.next_indices())
    x, y = x.to(run.mesh.device), y.to(run.mesh.device)
    loss = run.model(x, y)
    loss.backward()
    norm = zs.clip_grad_norm_(run.model, cfg.grad_clip) if cfg.grad_clip > 0 else None
    run.opt.step()
    run.opt.zero_grad()
    # Each rank's loss is the mean over an equal share of the global batch, so the mean of the
    # rank means is the global-batch loss that a single process would report.
    mean_loss = average_across_ranks(run, loss)
    dt = time.perf_counter() - t0
    tokens = cfg.batch * cfg.seq_len
    return StepRecord(
        step=step + 1, loss=mean_loss, lr=lr,
        grad_norm=None if norm is None else float(norm),
        step_time_s=dt, tokens=tokens, tokens_per_s=tokens / dt if dt > 0 else 0.0,
    )


def run_loop(run: Run, reporter: Reporter, metrics_file: Any | None) -> None:
    for step in range(run.cfg.steps):
        rec = train_step(run, step)
        run.records.append(rec)
        if metrics_file is not None:
            metrics_file.write(json.dumps(rec.__dict__) + "\n")
            metrics_file.flush()
        reporter.step(rec)


# --------------------------------------------------------------------------- outputs


def resolve_run_dir(cfg: TrainConfig) -> Path:
    if cfg.run_dir is not None:
        return Path(cfg.run_dir)
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():  # two runs started in the same second must not share a directory
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def comm_bytes_per_step(run: Run, bytes_before: int) -> float:
    """Bytes this rank put into training collectives per step, our metric all-reduces excluded.

    Taken from the ledger's running total rather than its records, which are a ring buffer
    that a long run overflows.
    """
    total = zs.ledger().total_bytes() - bytes_before - run.metric_bytes
    return total / len(run.records)


def run_info(run: Run, run_dir: Path | None) -> dict[str, Any]:
    return {
        "model": run.cfg.model,
        "params": run.num_params,
        "stage": run.cfg.stage,
        "world": run.mesh.world,
        "backend": run.mesh.backend,
        "device": str(run.mesh.device),
        "steps": run.cfg.steps,
        "global_batch": run.cfg.batch,
        "seq_len": run.cfg.seq_len,
        "entropy_floor": run.dataset.entropy_floor,
        "run_dir": None if run_dir is None else str(run_dir),
    }


def summarize(run: Run, info: dict[str, Any], bytes_before: int) -> dict[str, Any]:
    """Figures measured on this run; collective (every rank must call it)."""
    recs = run.records
    # The first step pays for lazy allocation and warm-up; leave it out of the timing if we can.
    timed = recs[1:] if len(recs) > 1 else recs
    mean_dt = sum(r.step_time_s for r in timed) / len(timed)
    tokens = sum(r.tokens for r in timed)
    # One batch's loss is noisy; the mean over the last tenth of the run is what to hold
    # against the entropy floor.
    tail = recs[-max(1, len(recs) // 10):]
    return {
        **info,
        "final_loss": recs[-1].loss,
        "first_loss": recs[0].loss,
        "tail_mean_loss": sum(r.loss for r in tail) / len(tail),
        "tail_steps": len(tail),
        "tokens_per_s": tokens / sum(r.step_time_s for r in timed),
        "mean_step_time_s": mean_dt,
        "timed_steps": len(timed),
        "comm_bytes_per_step": comm_bytes_per_step(run, bytes_before),
        "peak_rss_mb": max_across_ranks(run, peak_rss_mb()),
    }


def write_config(run_dir: Path, run: Run, info: dict[str, Any]) -> None:
    payload = {
        "train": run.cfg.to_dict(),
        "model": run.model_cfg.to_dict(),
        "world": info["world"],
        "backend": info["backend"],
        "params": info["params"],
        "entropy_floor": info["entropy_floor"],
        "torch": torch.__version__,
    }
    (run_dir / "config.json").write_text(json.dumps(payload, indent=2) + "\n")


# --------------------------------------------------------------------------- entry points


def train(cfg: TrainConfig, mesh: Any, reporter: Reporter | None = None) -> dict[str, Any]:
    """Run training on an initialised mesh; returns the summary (same figures on every rank)."""
    run = setup(cfg, mesh)
    is_main = mesh.rank == 0
    reporter = reporter if (reporter is not None and is_main) else NullReporter()
    run_dir = resolve_run_dir(cfg) if is_main else None
    info = run_info(run, run_dir)
    metrics_file = None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config(run_dir, run, info)
        metrics_file = (run_dir / "metrics.jsonl").open("w")
    bytes_before = zs.ledger().total_bytes()
    reporter.start(info)
    try:
        run_loop(run, reporter, metrics_file)
    finally:
        if metrics_file is not None:
            metrics_file.close()
    summary = summarize(run, info, bytes_before)
    reporter.finish(summary)
    return summary


def train_worker(cfg: TrainConfig, reporter: Reporter | None = None) -> dict[str, Any]:
    """Spawn/torchrun target: join the world, train, leave. Returns this rank's summary.

    On an error the process group is deliberately not torn down: a peer may be blocked in a
    collective, and tearing down could block too. The launcher (or torchrun) stops the peers.
    """
    mesh = zs.init(timeout_s=cfg.hang_timeout_s)
    summary = train(cfg, mesh, reporter)
    zs.shutdown()
    return summary


def verify_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Train quietly and return per-step losses; rank 0 also returns the full fp32 params."""
    mesh = zs.init(timeout_s=cfg.hang_timeout_s)
    run = setup(cfg, mesh)
    for step in range(cfg.steps):
        run.records.append(train_step(run, step))
    state = zs.full_state_dict(run.model)  # collective: every rank takes part
    params = {k: v.detach().float().cpu() for k, v in state.items()} if mesh.rank == 0 else None
    zs.shutdown()
    return {"losses": [r.loss for r in run.records], "params": params, "world": mesh.world}


def reference_train(cfg: TrainConfig) -> dict[str, Any]:
    """Plain single-process PyTorch: the numerical reference for `zeroshard verify`.

    Same seed, data, global batch, schedule, weight-decay groups and clipping as the
    distributed run, but no zeroshard runtime at all (no process group, no hooks).
    """
    dataset = build_data(cfg)
    model = build_model(cfg, dataset.vocab_size, torch.device("cpu"))
    opt = torch.optim.AdamW(
        zs.optim_groups(model, cfg.weight_decay), lr=lr_at(cfg, 0), betas=BETAS
    )
    sampler = GlobalBatchSampler(len(dataset), cfg.batch, world=1, rank=0, seed=cfg.seed)
    losses: list[float] = []
    for step in range(cfg.steps):
        set_lr(opt.param_groups, lr_at(cfg, step))
        x, y = collate(dataset, sampler.next_indices())
        loss = model(x, y)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "world": 1}
