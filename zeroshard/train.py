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

import contextlib
import dataclasses
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
from zeroshard.comm import desync, faults
from zeroshard.comm.collectives import all_gather_object, all_reduce
from zeroshard.comm.watchdog import Diagnostics, process_group_timeout
from zeroshard.checkpoint.training import maybe_save, open_metrics, resume
from zeroshard.config import TrainConfig, check_batch_split
from zeroshard.data import GlobalBatchSampler, build_dataset, collate
from zeroshard.models import adapter
from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.sharding import get_engine
from zeroshard.sharding.precision import parse_dtype
from zeroshard.profile import step as step_profile
from zeroshard.profile.timeline import phase

FAULT_ENV = "ZEROSHARD_FAULT"
"""Fault injection for tests: "rank=1,step=3" makes rank 1 raise at the start of step 3
(1-based, as printed)."""

BETAS = (0.9, 0.95)
IGNORE_INDEX = -100
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
    loss_scale: float | None = None
    profile: dict[str, Any] | None = None
    """This step's time breakdown, communication, memory and MFU (zeroshard/profile/step.py)."""


@dataclass(kw_only=True)
class Run:
    """Everything one rank holds for a run."""

    cfg: TrainConfig
    mesh: Any
    model: torch.nn.Module
    opt: Any
    scheduler: Any
    scaler: Any
    """A ShardedGradScaler for fp16 compute, else None."""
    dataset: Any
    sampler: GlobalBatchSampler
    model_cfg: Any
    """The GPTConfig, or for an hf: model its HFSpec; both have to_dict()."""
    num_params: int
    """Counted before sharding: at stage 3 the modules hold only this rank's slices."""
    records: list[StepRecord] = field(default_factory=list)
    metric_bytes: int = 0
    profiler: Any = None
    """A zeroshard.profile.step.StepProfiler, or None when profiling is off."""
    """Bytes of our own metric all-reduces, kept apart from the training traffic."""


# --------------------------------------------------------------------------- schedule and faults


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr` at the last step. `step` is 0-based."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - 1 - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def make_scheduler(cfg: TrainConfig, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A plain torch LambdaLR over `lr_at`; the loop steps it once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(cfg, step) / cfg.lr)


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


META_INIT_THRESHOLD = 50_000_000
"""Above this many params `init="auto"` builds on the meta device (see zeroshard/materialize.py)."""


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device, *,
                allow_meta: bool = True) -> torch.nn.Module:
    """Seed first, so every rank (and the single-process reference) starts bit-identical.

    On the meta device nothing is allocated; `zs.shard` later materialises this rank's shards
    with the values a plain build under the same seed would have. `hf:` names build a Hugging
    Face model (zeroshard/models/hf.py).
    """
    if adapter.is_hf_name(cfg.model):
        return adapter.build_hf(cfg, vocab_size, device, allow_meta=allow_meta, threshold=META_INIT_THRESHOLD)
    model_cfg = GPTConfig.named(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len)
    if allow_meta and use_meta_init(cfg, model_cfg):
        torch.manual_seed(cfg.seed)
        with zs.meta_init():
            return GPT(model_cfg)
    torch.manual_seed(cfg.seed)
    return GPT(model_cfg).to(device)


def use_meta_init(cfg: TrainConfig, model_cfg: GPTConfig) -> bool:
    if cfg.init != "auto":
        return cfg.init == "meta"
    with zs.meta_init():
        return GPT(model_cfg).num_params() > META_INIT_THRESHOLD


def mixed_precision(cfg: TrainConfig) -> zs.MixedPrecision | None:
    return None if cfg.mp == "fp32" else zs.MixedPrecision(param_dtype=parse_dtype(cfg.mp))


def setup(cfg: TrainConfig, mesh: Any) -> Run:
    check_batch_split(cfg.batch, mesh.world, cfg.accum)
    dataset = build_data(cfg)
    model = build_model(cfg, dataset.vocab_size, mesh.device)
    num_params = adapter.num_params(model)
    offload = zs.OffloadPolicy(kind=cfg.offload, directory=cfg.offload_dir) if cfg.offload != "none" else None
    zs.shard(model, stage=cfg.stage, mp=mixed_precision(cfg), bucket_mb=cfg.bucket_mb, prefetch=cfg.prefetch,
             reshard_after_forward=cfg.reshard_after_forward, accumulation=cfg.accumulation,
             checkpointing=cfg.checkpointing, offload=offload,
             comm=zs.CommQuant.parse(cfg.comm_quant, cfg.comm_quant_block), **adapter.shard_kwargs(model))
    faults.install(model, mesh.rank)  # ZEROSHARD_COMM_FAULT, for the watchdog/doctor tests; else nothing
    opt = zs.optimizer(model, torch.optim.AdamW, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=BETAS)
    scaler = zs.ShardedGradScaler(model) if cfg.mp == "fp16" else None
    sampler = GlobalBatchSampler(
        len(dataset), cfg.batch, world=mesh.world, rank=mesh.rank, seed=cfg.seed
    )
    return Run(
        cfg=cfg, mesh=mesh, model=model, opt=opt, scheduler=make_scheduler(cfg, opt), scaler=scaler,
        dataset=dataset, sampler=sampler, model_cfg=model.cfg, num_params=num_params,
    )


# --------------------------------------------------------------------------- the loop


def max_across_ranks(run: Run, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float32, device=run.mesh.device)
    all_reduce(t, op="max", phase=METRICS_PHASE)
    run.metric_bytes += t.numel() * t.element_size()
    return float(t.item())


def global_token_count(run: Run, targets: torch.Tensor) -> torch.Tensor:
    """Tokens that carry a loss (targets != -100) in the whole global batch, on every rank."""
    count = (targets != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
    all_reduce(count, op="sum", phase=METRICS_PHASE)
    run.metric_bytes += count.numel() * count.element_size()
    return count


def accumulate_gradients(run: Run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward/backward over `accum` micro-batches; returns this rank's summed token loss.

    Every micro-step backpropagates `loss_sum * world / global_tokens`: the runtime averages
    over ranks (divides by world), so the gradient is exactly the mean over every loss-carrying
    token of the global batch, however unevenly masked tokens fall across micro-batches and ranks.
    """
    cfg, model = run.cfg, run.model
    norm = run.mesh.world / global_token_count(run, y)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    micro = list(zip(x.chunk(cfg.accum), y.chunk(cfg.accum)))
    for index, (xm, ym) in enumerate(micro):
        last = index == len(micro) - 1
        with contextlib.nullcontext() if last else zs.no_sync(model):
            with phase("forward"):
                loss_sum, _ = adapter.loss_sum(model, xm, ym)
            scaled = loss_sum * norm.to(loss_sum.dtype)
            with phase("backward"):
                (run.scaler.scale(scaled) if run.scaler is not None else scaled).backward()
        total += loss_sum.detach().double()
    return total


def optimizer_step(run: Run) -> float | None:
    """Unscale (fp16), clip on the global norm, step unless any rank overflowed, then advance the
    LR schedule: once per optimizer step, never per micro-step."""
    cfg, scaler = run.cfg, run.scaler
    if scaler is not None:
        scaler.unscale_(run.opt)
    norm = zs.clip_grad_norm_(run.model, cfg.clip) if cfg.clip > 0 else None
    if scaler is not None:
        scaler.step(run.opt)
        scaler.update()
    else:
        run.opt.step()
    run.scheduler.step()
    run.opt.zero_grad()
    return None if norm is None else float(norm)


def train_step(run: Run, step: int) -> StepRecord:
    """One optimizer step on this rank's slice of the global batch."""
    cfg = run.cfg
    t0 = time.perf_counter()
    maybe_inject_fault(run.mesh.rank, step + 1)  # 1-based, as the progress output counts
    lr = run.opt.param_groups[0]["lr"]
    with phase("data"):
        x, y = collate(run.dataset, run.sampler.next_indices())
        x, y = x.to(run.mesh.device), y.to(run.mesh.device)
    loss_sum = accumulate_gradients(run, x, y)
    with phase("optimizer"):
        norm = optimizer_step(run)
    mean_loss = average_token_loss(run, loss_sum, y)
    dt = time.perf_counter() - t0
    tokens = cfg.batch * cfg.seq_len
    return StepRecord(
        step=step + 1, loss=mean_loss, lr=lr, grad_norm=norm,
        step_time_s=dt, tokens=tokens, tokens_per_s=tokens / dt if dt > 0 else 0.0,
        loss_scale=None if run.scaler is None else run.scaler.get_scale(),
    )


def average_token_loss(run: Run, loss_sum: torch.Tensor, y: torch.Tensor) -> float:
    """The global batch's mean token loss, as a single process would report it."""
    totals = torch.stack([loss_sum, (y != IGNORE_INDEX).sum().double()]).reshape(2)
    all_reduce(totals, op="sum", phase=METRICS_PHASE)
    run.metric_bytes += totals.numel() * totals.element_size()
    return float(totals[0] / totals[1])


def run_loop(run: Run, reporter: Reporter, metrics_file: Any | None, run_dir: Path | None = None,
             start: int = 0) -> None:
    """Steps `start` .. `cfg.steps - 1` (0-based); `start` > 0 after a resume."""
    for step in range(start, run.cfg.steps):
        zs.ledger().step = step + 1  # stamped on every collective of the step, for the doctor
        if run.profiler is not None:
            run.profiler.begin(step)
        rec = train_step(run, step)
        if run.profiler is not None:
            rec.profile = run.profiler.end(step)
        run.records.append(rec)
        if step == start and run_dir is not None:
            # After the first step, so the optimizer's lazily created state shows its real dtypes.
            write_manifest(run_dir, run)
        if metrics_file is not None:
            metrics_file.write(json.dumps(rec.__dict__) + "\n")
            metrics_file.flush()
        reporter.step(rec)
        if run.cfg.desync_check and (step + 1) % run.cfg.desync_check == 0:
            run.metric_bytes += desync.check(step + 1)
        with phase("checkpoint"):
            maybe_save(run, step + 1)


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
        "accum": run.cfg.accum,
        "precision": zs.precision_manifest(run.model, run.opt),
        "init_path": get_engine(run.model).init_stats["path"],
        "skipped_steps": 0 if run.scaler is None else run.scaler.skipped_steps,
        "profile": None if run.profiler is None else run.profiler.summary(),
    }


def write_manifest(run_dir: Path, run: Run) -> None:
    manifest = {"precision": zs.precision_manifest(run.model, run.opt), "accum": run.cfg.accum,
                "loss_scaling": run.scaler.state_dict() if run.scaler is not None else None}
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


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
    start = resume(run)  # 0 unless cfg.resume found a checkpoint
    is_main = mesh.rank == 0
    reporter = reporter if (reporter is not None and is_main) else NullReporter()
    run_dir = resolve_run_dir(cfg) if is_main else None
    info = run_info(run, run_dir)
    metrics_file = None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config(run_dir, run, info)
        metrics_file = open_metrics(run_dir / "metrics.jsonl", start)
    bytes_before = zs.ledger().total_bytes()
    # Every rank writes its own profile (and trace) files, so it needs the run dir too.
    run.profiler = step_profile.for_run(run, cfg.run_dir or run_dir)
    reporter.start(info)
    with run.profiler or contextlib.nullcontext():
        try:
            run_loop(run, reporter, metrics_file, run_dir, start)
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
    # gloo's own timeout comes after the watchdog's, which names the collective and leaves dumps.
    mesh = zs.init(timeout_s=process_group_timeout(cfg.hang_timeout_s), shard_size=cfg.shard_size)
    # Rank 0 names the run dir (a timestamp by default); every rank dumps its ledger there.
    run_dir = all_gather_object(str(resolve_run_dir(cfg)), phase="init")[0]
    cfg = dataclasses.replace(cfg, run_dir=run_dir)
    with Diagnostics(zs.ledger(), run_dir=run_dir, rank=mesh.rank, world=mesh.world,
                     hang_timeout_s=cfg.hang_timeout_s):
        summary = train(cfg, mesh, reporter)
    zs.shutdown()
    return summary


def verify_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Train quietly and return per-step losses; rank 0 also returns the full fp32 params."""
    mesh = zs.init(timeout_s=cfg.hang_timeout_s, shard_size=cfg.shard_size)
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
    distributed run, but no zeroshard runtime at all (no process group, no hooks) and no
    accumulation: one fp32 forward/backward over the whole global batch per step.
    """
    dataset = build_data(cfg)
    model = build_model(cfg, dataset.vocab_size, torch.device("cpu"), allow_meta=False)
    opt = torch.optim.AdamW(zs.optim_groups(model, cfg.weight_decay), lr=cfg.lr, betas=BETAS)
    scheduler = make_scheduler(cfg, opt)
    sampler = GlobalBatchSampler(len(dataset), cfg.batch, world=1, rank=0, seed=cfg.seed)
    losses: list[float] = []
    for _ in range(cfg.steps):
        x, y = collate(dataset, sampler.next_indices())
        loss = adapter.mean_loss(model, x, y)
        loss.backward()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        scheduler.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "world": 1}
