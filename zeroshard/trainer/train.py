"""The training loop, made of small functions, run identically on every rank.

`train_worker(cfg)` is the entry point: the CLI passes it to `zeroshard.trainer.launch.spawn` for local
runs, or calls it directly under torchrun. It joins the process group, builds the same model on
every rank (same seed, so no broadcast is needed), shards it, and runs `cfg.steps` optimizer
steps over the GLOBAL batch, of which each rank takes its contiguous slice.

`reference_train(cfg)` is the plain single-process PyTorch loop that `zeroshard verify`
compares against: no zeroshard runtime, the same model, data, schedule and clipping.

The run's instruments (hang watchdog and ledger dumps, profiler, desync check, metrics.jsonl,
loggers, summary) come from `zs.observe`, the same entry a user's own loop takes. Rank 0 reports
through a `Reporter` (the CLI supplies a rich one) and also writes `RUN_DIR/config.json`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from zeroshard.parallel.cp import context_of
from zeroshard.comm import get_ledger as zs_ledger
from zeroshard.comm.mesh import shutdown
from zeroshard.comm.world import init
from zeroshard.observing import observe as zs_observe
from zeroshard.runtime import full_state_dict as zs_full_state_dict, precision_manifest
from zeroshard.comm import fault_points as fault_points
from zeroshard.comm.collectives import all_reduce
from zeroshard.observing.watchdog import process_group_timeout
from zeroshard.checkpoint.training import TrainingCheckpoints
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.config_checks import check_runnable, pp_microbatches
from zeroshard.trainer.data import GlobalBatchSampler, collate
from zeroshard.trainer.data_pack import collate_positions
from zeroshard.trainer.evaluate import EvalResult, evaluate
from zeroshard.trainer.optimizers import plain_optimizers
from zeroshard.trainer import adapter
from zeroshard.runtime import get_engine
from zeroshard.trainer import step as step_mod
from zeroshard.trainer.heal import SpikeWatch, heal_summary, injected_spike, rollback
from zeroshard.trainer.step import (  # noqa: F401 - re-exported: callers import the run's parts from here
    BETAS, IGNORE_INDEX, METRICS_PHASE, META_INIT_THRESHOLD, Run, build_data, build_model, lr_at, make_scheduler,
    mixed_precision, use_meta_init,
)
from zeroshard.observing import Observer
from zeroshard.observing.observer import default_run_dir
from zeroshard.observing.profile.timeline import phase




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
    skipped: bool = False
    """The non-finite guard skipped this step's update on every rank (zeroshard/runtime/guard.py)."""
    profile: dict[str, Any] | None = None
    """This step's time breakdown, communication, memory and MFU (zeroshard/observing/profile/step.py)."""
    eval: dict[str, float] | None = None
    """After an evaluation: the held-out loss, perplexity and tokens (zeroshard/trainer/evaluate.py)."""


# --------------------------------------------------------------------------- building


def setup(cfg: TrainConfig, mesh: Any) -> Run:
    """This rank's run of `cfg` (zeroshard/trainer/step.py builds it)."""
    fault_points.configure()  # a malformed ZEROSHARD_*FAULT variable fails here, before anything is built
    return step_mod.build(cfg, mesh)


# --------------------------------------------------------------------------- the loop


def max_across_ranks(run: Run, value: float) -> float:
    run.metric_bytes += 4  # one float32
    return step_mod.slowest_rank(value, run.mesh.device)


def train_step(run: Run, step: int) -> StepRecord:
    """One optimizer step on this rank's slice of the global batch."""
    cfg = run.cfg
    t0 = time.perf_counter()
    fault_points.point("train.step", rank=run.mesh.rank, step=step + 1)  # 1-based, as the progress counts
    fault_points.point("train.kill", rank=run.mesh.rank, step=step + 1)  # ZEROSHARD_KILL_FAULT: a lost node
    lr = run.opt.param_groups[0]["lr"]
    with phase("data"):
        indices = run.sampler.next_indices()
        x, y = collate(run.dataset, indices)
        x, y = x.to(run.mesh.device), y.to(run.mesh.device)
        positions = collate_positions(run.dataset, indices)  # packed samples' position_ids, or None
        positions = None if positions is None else positions.to(run.mesh.device)
    out = step_mod.step(run, x, y, positions=positions)
    loss_sum, norm = out.loss_sum, out.grad_norm
    mean_loss = injected_spike(average_token_loss(run, loss_sum, y), step + 1)  # ZEROSHARD_SPIKE_FAULT, else as is
    dt = time.perf_counter() - t0
    tokens = cfg.batch * cfg.seq_len
    return StepRecord(
        step=step + 1, loss=mean_loss, lr=lr, grad_norm=norm,
        step_time_s=dt, tokens=tokens, tokens_per_s=tokens / dt if dt > 0 else 0.0,
        loss_scale=None if run.scaler is None else run.scaler.get_scale(), skipped=step_mod.skipped(run.model),
    )


def average_token_loss(run: Run, loss_sum: torch.Tensor, y: torch.Tensor) -> float:
    """The global batch's mean token loss, as a single process would report it."""
    cp = context_of(run.model)
    y = y if cp is None else cp.split(y)  # a cp rank's loss_sum is over its tokens only
    totals = torch.stack([loss_sum, (y != IGNORE_INDEX).sum().double()]).reshape(2)
    all_reduce(totals, op="sum", phase=METRICS_PHASE)
    run.metric_bytes += totals.numel() * totals.element_size()
    return float(totals[0] / totals[1])


def run_loop(run: Run, reporter: Reporter, obs: Observer | None = None, start: int = 0,
             ckpts: TrainingCheckpoints | None = None) -> None:
    """Steps `start` .. `cfg.steps - 1` (0-based); `start` > 0 after a resume. `obs` (entered and
    attached) records each step; without one the steps only reach `reporter`. `ckpts` saves
    every `cfg.save_every` steps (one is made when not given)."""
    ckpts = TrainingCheckpoints(run) if ckpts is None else ckpts
    watch = SpikeWatch(run.cfg.rollback_on_spike, run.cfg.rollback_window)
    step = start
    while step < run.cfg.steps:
        zs_ledger().step = step + 1  # stamped on every collective of the step, for the doctor
        rec = train_step(run, step)
        result = evaluate_if_due(run, step + 1)
        if result is not None:
            rec.eval = result.fields()
        if obs is not None:
            fields = {k: v for k, v in rec.__dict__.items() if k not in ("step", "profile", "eval")}
            fields.update(rec.eval or {})
            rec.profile = obs.step(**fields, **ckpts.step_fields())["profile"]
            if step == start and obs.rank == 0:
                # After the first step, so the optimizer's lazily created state shows its real dtypes.
                write_manifest(obs.run_dir, run)
        run.records.append(rec)
        reporter.step(rec)
        mean = watch.spike(rec.loss, rec.skipped)
        if mean is not None:  # before saving: the spiked state is never checkpointed
            restored = rollback(run, ckpts, obs, rec.step, rec.loss, mean)
            if restored is not None:
                step = restored
                watch.reset()
                continue
        with phase("checkpoint"):
            ckpts.after_step(step + 1)
        step += 1


def evaluate_if_due(run: Run, step: int) -> EvalResult | None:
    """The held-out loss after 1-based `step` when `eval.every` divides it or it is the last; collective."""
    every, last = run.cfg.eval.every, step == run.cfg.steps
    if run.eval_data is None or not (last or (every and step % every == 0)):
        return None
    micro = run.cfg.batch // run.mesh.dp_size // run.cfg.accum  # the training micro-batch: its memory is known
    with phase("eval"):
        result = evaluate(run.model, run.eval_data, run.mesh, micro=micro)
    run.metric_bytes += result.metric_bytes
    return result


# --------------------------------------------------------------------------- outputs


def resolve_run_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.run_dir) if cfg.run_dir is not None else default_run_dir()


def run_info(run: Run, run_dir: Path | None) -> dict[str, Any]:
    return {
        "model": run.cfg.model,
        "params": run.num_params,
        "stage": run.cfg.stage,
        "world": run.mesh.world,
        "tp": run.mesh.tp_size,
        "ep": run.mesh.ep_size,
        "pp": run.mesh.pp_size,
        "backend": run.mesh.backend,
        "device": str(run.mesh.device),
        "steps": run.cfg.steps,
        "global_batch": run.cfg.batch,
        "seq_len": run.cfg.seq_len,
        "entropy_floor": run.dataset.entropy_floor,
        "run_dir": None if run_dir is None else str(run_dir),
        "topology": run.mesh.topology_summary(),
        "model_config": run.model_cfg.to_dict(),
    }


def summarize(run: Run, info: dict[str, Any], obs: Observer) -> dict[str, Any]:
    """Figures measured on this run; collective (every rank must call it). The observer's summary
    (timing, comm bytes per step with our metric all-reduces excluded, peak RSS, profile) plus what
    only a `TrainConfig` run knows."""
    return {
        **obs.summary(exclude_bytes=run.metric_bytes),
        **info,
        "accum": run.cfg.accum,
        "precision": precision_manifest(run.model, run.opt),
        "init_path": get_engine(run.model).init_stats["path"],
        "skipped_steps": 0 if run.scaler is None else run.scaler.skipped_steps,
        **heal_summary(run),
    }


def write_manifest(run_dir: Path, run: Run) -> None:
    manifest = {"precision": precision_manifest(run.model, run.opt), "accum": run.cfg.accum,
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


def observer_for(cfg: TrainConfig) -> Observer:
    """The `zs.observe` entry that a `TrainConfig` run trains inside."""
    return zs_observe(resolve_run_dir(cfg), hang_timeout_s=cfg.hang_timeout_s, profile=cfg.profile, trace=cfg.trace,
                      log=cfg.log, desync_check=cfg.desync_check, peak_flops=cfg.peak_flops, batch=cfg.batch,
                      tokens_per_step=cfg.batch * cfg.seq_len, config=cfg.to_dict())


def train(cfg: TrainConfig, mesh: Any, obs: Observer, reporter: Reporter | None = None) -> dict[str, Any]:
    """Run training on an initialised mesh inside an entered `obs`; returns the summary (same
    figures on every rank). Building and resuming run under the watchdog too."""
    run = setup(cfg, mesh)
    ckpts = TrainingCheckpoints(run)
    start = ckpts.resume()  # 0 unless cfg.resume found a checkpoint
    is_main = mesh.rank == 0
    reporter = reporter if (reporter is not None and is_main) else NullReporter()
    info = run_info(run, obs.run_dir if is_main else None)
    if is_main:
        write_config(obs.run_dir, run, info)
    if cfg.replica_recovery:  # a replacement keeps the records its group wrote before it died
        from zeroshard.trainer.replicas import logged_before

        start = logged_before(obs.run_dir)
    obs.attach(run.model, start_step=start)
    run.profiler = obs.profiler
    if run.profiler is not None and run.pipeline is not None:
        run.profiler.watch_pipeline(run.pipeline)
    reporter.start(info)
    healed: dict[str, Any] = {}
    if cfg.replica_recovery:  # the replica groups train on as long as one lives (zeroshard/trainer/replicas.py)
        from zeroshard.trainer.replicas import run_replica_loop

        healed = run_replica_loop(run, reporter, obs, timeout_s=min(60.0, cfg.hang_timeout_s))
    else:
        run_loop(run, reporter, obs, start, ckpts)
    ckpts.close()  # an asynchronous save still in flight commits (or fails) before the summary
    summary = {**summarize(run, info, obs), **healed}
    if healed and mesh.rank == 0:  # summary.json was written by the observer; add what the groups did
        (obs.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    ckpts.record_resize(summary, obs.run_dir)
    reporter.finish(summary)
    return summary


def train_worker(cfg: TrainConfig, reporter: Reporter | None = None) -> dict[str, Any]:
    """Spawn/torchrun target: join the world, train, leave. Returns this rank's summary.

    On an error the process group is deliberately not torn down: a peer may be blocked in a
    collective, and tearing down could block too. The launcher (or torchrun) stops the peers.
    """
    check_runnable(cfg)  # a library caller's config, checked against the model as the CLI's is
    # gloo's own timeout comes after the watchdog's, which names the collective and leaves dumps.
    mesh = init(backend=cfg.backend, timeout_s=process_group_timeout(cfg.hang_timeout_s),
                   shard_size=cfg.shard_size, tp=cfg.tp, ep=cfg.ep, pp=cfg.pp, cp=cfg.cp,
                   allow_cross_host=cfg.allow_cross_host)
    with observer_for(cfg) as obs:  # rank 0 names the run dir; every rank dumps its ledger there
        summary = train(cfg.replace(run_dir=str(obs.run_dir)), mesh, obs, reporter)
    shutdown()
    return summary


def verify_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Train quietly and return per-step losses; rank 0 also returns the full fp32 params."""
    mesh = init(backend=cfg.backend, timeout_s=cfg.hang_timeout_s, shard_size=cfg.shard_size, tp=cfg.tp, pp=cfg.pp,
                   ep=cfg.ep, cp=cfg.cp, allow_cross_host=cfg.allow_cross_host)
    run = setup(cfg, mesh)
    for step in range(cfg.steps):
        run.records.append(train_step(run, step))
    # Collective: every rank takes part (with pp, every stage's params come to every rank).
    state = run.pipeline.full_state_dict() if run.pipeline is not None else zs_full_state_dict(run.model)
    params = {k: v.detach().float().cpu() for k, v in state.items()} if mesh.rank == 0 else None
    shutdown()
    return {"losses": [r.loss for r in run.records], "params": params, "world": mesh.world}


def batch_nonlinear_loss(model: torch.nn.Module) -> bool:
    """Whether the model's loss is not a sum over its rows: an MoE load-balancing loss multiplies two
    means over the batch (zeroshard's GPT with aux_loss_coef > 0, a Hugging Face MoE config with
    output_router_logits), so it depends on how a step is cut into micro-batches, and a reference
    must cut it the same way."""
    from zeroshard.models.router_aux import router_aux_coef

    cfg = getattr(model, "cfg", None)
    return bool(getattr(cfg, "n_expert", 0) and getattr(cfg, "aux_loss_coef", 0.0)) or bool(router_aux_coef(model))


def global_micro_batches(x: torch.Tensor, y: torch.Tensor, *, dp: int,
                         accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch as the distributed step cuts it: micro-batch m is micro-batch m of every
    data-parallel rank's contiguous slice (rank order), which is what its collectives see together."""
    per_rank, micro = x.shape[0] // dp, x.shape[0] // dp // accum
    out = []
    for m in range(accum):
        rows = [r * per_rank + m * micro + j for r in range(dp) for j in range(micro)]
        out.append((x[rows], y[rows]))
    return out


def reference_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, dp: int,
                       accum: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """One process's backward of a global batch, as the distributed step computes it; returns the
    step's mean loss. A loss that is not a sum over samples (an MoE load-balancing term) is
    backpropagated over the distributed step's own global micro-batches, so both see the same ones."""
    if batch_nonlinear_loss(model) and accum > 1:
        count, loss = (y != IGNORE_INDEX).sum(), torch.zeros(())
        for xm, ym in global_micro_batches(x, y, dp=dp, accum=accum):
            loss_sum, _ = adapter.loss_sum(model, xm, ym)
            (loss_sum / count).backward()
            loss = loss + loss_sum.detach() / count
        return loss
    loss = adapter.mean_loss(model, x, y, positions)
    loss.backward()
    return loss


def reference_train(cfg: TrainConfig, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Plain single-process PyTorch: the numerical reference for `zeroshard verify`.

    Same seed, data, global batch, schedule, weight-decay groups and clipping as the
    distributed run, but no zeroshard runtime at all (no process group, no hooks) and no
    accumulation: one fp32 forward/backward over the whole global batch per step. A loss that is
    not a sum over rows (an MoE load-balancing loss, ``batch_nonlinear_loss``) is accumulated
    over the distributed step's own global micro-batches instead, where that loss is defined.
    ``model`` replaces the model ``cfg`` names (a test's own, built as its distributed run's is).
    """
    dataset = build_data(cfg)
    model = build_model(cfg, dataset.vocab_size, torch.device("cpu"), allow_meta=False) if model is None else model
    opts = plain_optimizers(cfg.optimizer, model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    opt = opts[0] if len(opts) == 1 else step_mod.Each(opts)
    scheduler = make_scheduler(cfg, opts[0]) if len(opts) == 1 else step_mod.Each([make_scheduler(cfg, o) for o in opts])
    sampler = GlobalBatchSampler(len(dataset), cfg.batch, world=1, rank=0, seed=cfg.seed)
    losses: list[float] = []
    norms: list[float] = []
    for _ in range(cfg.steps):
        indices = sampler.next_indices()
        x, y = collate(dataset, indices)
        # Under pp each accumulation step's slice is cut into the schedule's microbatches too.
        loss = reference_backward(model, x, y, dp=cfg.dims.dp, accum=cfg.accum * pp_microbatches(cfg),
                                  positions=collate_positions(dataset, indices))
        if cfg.clip > 0:  # the global norm before clipping, as a distributed step reports it
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)))
        opt.step()
        scheduler.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "world": 1, "norms": norms}
