"""The training step: how a run is built from a `TrainConfig`, and one optimizer step of it.

This is the only place the step is written. `zeroshard train`, `zeroshard tune`, the planner's
`--measure`, the benchmarks and the distributed tests all call it, so what they time, measure or
check is what training runs. Callers that need to look inside a step (a memory tracker, saved
activations, the grads before they are zeroed) pass hooks (`micro`, `before_zero_grad`) rather
than writing their own loop. The one other loop is `zeroshard.trainer.train.reference_train`, the plain
PyTorch reference that the runtime is checked against.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch

from zeroshard.comm.mesh import get_mesh
from zeroshard.runtime import (
    CommQuant,
    EngineOptions,
    MixedPrecision,
    ShardedGradScaler as zs_ShardedGradScaler,
    clip_grad_norm_ as zs_clip_grad_norm_,
    mesh_of,
    no_sync,
    shard as zs_shard,
)
from zeroshard.runtime import guard
from zeroshard.runtime.engine import get_engine
from zeroshard.runtime.materialize import meta_init
from zeroshard.comm import faults, host_sync
from zeroshard.comm.collectives import all_reduce
from zeroshard.observing.rank_metrics import METRICS_PHASE, slowest_per_step, slowest_rank  # noqa: F401  (the tools time steps with them)
from zeroshard.models.names import HF_PREFIX
from zeroshard.trainer.config import TrainConfig, check_batch_split
from zeroshard.trainer.data import GlobalBatchSampler, build_dataset, data_tokenizer
from zeroshard.trainer.optimizers import BETAS, sharded_optimizer  # noqa: F401 (BETAS: the tools read it here)
from zeroshard.trainer import adapter
from zeroshard.trainer.heal import load_skips
from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.observing.profile.timeline import phase
from zeroshard.runtime.precision import parse_dtype
from zeroshard.trainer.ep_setup import apply_expert_parallel
from zeroshard.trainer.lora import apply_lora
from zeroshard.trainer.schedules import lr_of
from zeroshard.trainer.tp_setup import apply_tensor_parallel
from zeroshard.parallel.cp import apply_context_parallel, context_of, share_context

IGNORE_INDEX = -100
META_INIT_THRESHOLD = 50_000_000
"""Above this many params `init="auto"` builds on the meta device (see zeroshard/runtime/materialize.py)."""

Micro = Callable[[int], ContextManager[Any]]
"""`micro(index)` returns a context entered around micro-step `index`'s forward and backward."""


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
    records: list[Any] = field(default_factory=list)
    """One `zeroshard.trainer.train.StepRecord` per step taken."""
    metric_bytes: int = 0
    """Bytes of our own metric all-reduces, kept apart from the training traffic."""
    profiler: Any = None
    """A zeroshard.observing.profile.step.StepProfiler, or None when profiling is off."""
    eval_data: Any = None
    """The held-out rows `eval.data` names (read as the training data is), or None."""
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    """Each spike rollback taken (zeroshard/trainer/heal.py), as written to RUN_DIR/rollbacks.jsonl."""
    pipeline: Any = None
    """With pp > 1, the zeroshard.parallel.pipeline.Pipeline of this rank's stages; `model` is then its first
    stage module and `opt` / `scheduler` drive one per stage."""


@dataclass(frozen=True)
class StepOutcome:
    loss_sum: torch.Tensor
    """This rank's summed token loss (float64), over every micro-batch."""
    grad_norm: float | None
    """The global grad norm before clipping; None when clipping is off."""
    metric_bytes: int
    """Bytes of the step's own metric all-reduce (the global token count)."""


# --------------------------------------------------------------------------- schedule


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate at 0-based step `step` under the run's `lr_schedule` (zeroshard/trainer/schedules.py)."""
    return lr_of(cfg, step)


def make_scheduler(cfg: TrainConfig, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A plain torch LambdaLR over `lr_at`; the step advances it once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(cfg, step) / cfg.lr)


# --------------------------------------------------------------------------- building


def build_data(cfg: TrainConfig, path: str | None = None) -> Any:
    """The run's training data, or with ``path`` other data read the same way (the held-out set)."""
    return build_dataset(
        data_path=cfg.data.path if path is None else path, seq_len=cfg.seq_len, num_samples=cfg.num_samples,
        vocab_size=cfg.vocab_size, order=cfg.order, seed=cfg.seed, tokenizer=data_tokenizer(cfg.model, cfg.data.tokenizer),
        packing=cfg.packing, doc_mask=cfg.doc_mask,
    )



def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device, *,
                allow_meta: bool = True) -> torch.nn.Module:
    """Seed first, so every rank (and the single-process reference) starts bit-identical.

    On the meta device nothing is allocated; `zs.shard` later materialises this rank's shards
    with the values a plain build under the same seed would have. `hf:` names build a Hugging
    Face model (zeroshard/models/hf.py).
    """
    allow_meta = allow_meta and not cfg.lora.enabled  # LoRA adapters go into a base built whole
    return apply_lora(cfg, _build_base(cfg, vocab_size, device, allow_meta=allow_meta))


def _build_base(cfg: TrainConfig, vocab_size: int, device: torch.device, *, allow_meta: bool) -> torch.nn.Module:
    if adapter.is_hf_name(cfg.model):
        return adapter.build_hf(cfg, vocab_size, device, allow_meta=allow_meta, threshold=META_INIT_THRESHOLD)
    model_cfg = GPTConfig.named(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len)
    if allow_meta and use_meta_init(cfg, model_cfg):
        torch.manual_seed(cfg.seed)
        with meta_init():
            return GPT(model_cfg)
    torch.manual_seed(cfg.seed)
    return GPT(model_cfg).to(device)


def use_meta_init(cfg: TrainConfig, model_cfg: GPTConfig) -> bool:
    if cfg.init != "auto":
        return cfg.init == "meta"
    with meta_init():
        return GPT(model_cfg).num_params() > META_INIT_THRESHOLD


def mixed_precision(cfg: TrainConfig) -> MixedPrecision | None:
    return None if cfg.mp == "fp32" else MixedPrecision(param_dtype=parse_dtype(cfg.mp))


ENGINE_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(EngineOptions))
"""The `zs.shard` keywords that go into the engine's options rather than beside them."""


def engine_options(cfg: TrainConfig, **overrides: Any) -> EngineOptions:
    """`cfg.engine` with ``overrides`` (engine keywords) on top."""
    return dataclasses.replace(cfg.engine, **overrides)


def shard_model(cfg: TrainConfig, model: torch.nn.Module, **overrides: Any) -> torch.nn.Module:
    """`zs.shard` with every sharding option of `cfg`, offload and the model's own kwargs included.
    `overrides` replace or add `zs.shard` arguments (a test passing its own precision policy or
    prefetch); engine keywords among them go into the options."""
    options = engine_options(cfg, **{k: overrides.pop(k) for k in ENGINE_OPTION_NAMES if k in overrides})
    kwargs = dict(stage=cfg.stage, mp=mixed_precision(cfg), options=options,
                  comm=CommQuant.parse(cfg.comm_quant, cfg.comm_quant_block),
                  compile=cfg.compile.backend if cfg.compile.enabled else None, **adapter.shard_kwargs(model))
    zs_shard(model, **{**kwargs, **overrides})
    adapter.after_shard(model)  # a pretrained folder: each rank reads only its shard of the weights
    return model


def build(cfg: TrainConfig, mesh: Any, *, model: torch.nn.Module | None = None, dataset: Any = None,
          **shard_overrides: Any) -> Run:
    """A run of `cfg` on this rank: data, sharded model, optimizer, scaler, schedule and sampler.

    `model` replaces the model `cfg` names (a test's own module, built before sharding);
    `dataset` replaces the one `cfg` describes; `shard_overrides` go to `zs.shard`.
    """
    check_batch_split(cfg.batch, mesh.dp_size, cfg.accum)
    if cfg.pp > 1:
        return _build_pipeline(cfg, mesh, model=model, dataset=dataset, **shard_overrides)
    dataset = build_data(cfg) if dataset is None else dataset
    model = build_model(cfg, dataset.vocab_size, mesh.device) if model is None else model
    num_params = adapter.num_params(model)
    apply_tensor_parallel(cfg, model, mesh)  # cfg.tp > 1: split the blocks before zs.shard flattens them
    apply_expert_parallel(cfg, model, mesh)  # an ep dim: keep this rank's experts, route tokens to the others
    apply_context_parallel(model, mesh, cfg.cp_attention)  # a cp dim: attention exact over split sequences
    shard_model(cfg, model, **{"mesh": mesh, **shard_overrides})
    faults.install(model, mesh.rank)  # ZEROSHARD_COMM_FAULT, for the watchdog/doctor tests; else nothing
    opt = sharded_optimizer(cfg.optimizer, model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    configure_guard(cfg, [model])
    scaler = zs_ShardedGradScaler(model) if cfg.mp == "fp16" else None
    # Tensor-parallel ranks (zs.init(tp=N)) share a batch: data is split over the data-parallel ranks only.
    sampler = make_sampler(cfg, dataset, mesh)
    return Run(
        cfg=cfg, mesh=mesh, model=model, opt=opt, scheduler=make_scheduler(cfg, opt), scaler=scaler,
        dataset=dataset, sampler=sampler, model_cfg=getattr(model, "cfg", None), num_params=num_params,
        eval_data=build_data(cfg, cfg.eval.data) if cfg.eval.data is not None else None,
    )


def make_sampler(cfg: TrainConfig, dataset: Any, mesh: Any) -> GlobalBatchSampler:
    """This rank's sampler; `skip_from` passes over the batches a rolled-back run skipped."""
    from zeroshard.comm.replicas import replica_index

    world, rank = mesh.dp_size, mesh.dp_rank
    if cfg.replica_recovery:  # the replica groups split the global batch too (zeroshard/trainer/replicas.py)
        world, rank = cfg.replicas * world, replica_index() * world + rank
    sampler = GlobalBatchSampler(len(dataset), cfg.batch, world=world, rank=rank, seed=cfg.seed)
    if cfg.skip_from is not None:
        sampler.skip |= load_skips(cfg.skip_from)
    return sampler


def configure_guard(cfg: TrainConfig, modules: Sequence[torch.nn.Module]) -> None:
    """The non-finite guard of each engine (zeroshard/runtime/guard.py): on unless `skip_nonfinite` is
    off, stopping after `max_bad_steps` consecutive skips with its report in the run dir."""
    for module in modules:
        guard.configure(get_engine(module), enabled=cfg.skip_nonfinite, max_bad_steps=cfg.max_bad_steps,
                        report_dir=cfg.run_dir)


def skipped(model: torch.nn.Module) -> bool:
    """Whether the non-finite guard skipped the step just taken (on every rank alike)."""
    return guard.skipped(get_engine(model))


class Each:
    """One optimizer (or LR scheduler) per pipeline stage of this rank, driven as one: the step
    calls ``step`` and ``zero_grad`` once each, and a reader of ``param_groups`` (the LR) or ``state``
    sees the first stage's, which every stage shares."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    @property
    def param_groups(self) -> list[dict]:
        return self.items[0].param_groups

    @property
    def state(self) -> Any:
        return self.items[0].state

    def step(self) -> None:
        for item in self.items:
            item.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for item in self.items:
            item.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The first stage's (LR schedulers): every stage's steps with it, so they hold the same state."""
        return self.items[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for item in self.items:
            item.load_state_dict(state)


def _build_pipeline(cfg: TrainConfig, mesh: Any, *, model: torch.nn.Module | None, dataset: Any,
                    **shard_overrides: Any) -> Run:
    """A run whose model is cut into `cfg.pp` stages (docs/pipeline.md): this rank's stages, one
    `zs.shard` engine and one optimizer each, and the same data as any rank of its data-parallel index."""
    from zeroshard.parallel.pipeline import Pipeline

    if mesh.pp_size != cfg.pp:
        raise ValueError(f"pp={cfg.pp} but the mesh's pp dim is {mesh.pp_size}; build the mesh with "
                         f"zs.init(pp={cfg.pp}) (zeroshard train does)")
    dataset = build_data(cfg) if dataset is None else dataset
    if getattr(dataset, "positions", None) is not None and dataset.positions(0) is not None:
        raise ValueError("packed samples (or doc_mask) need pp=1: a pipeline stage takes no position_ids yet; "
                         "use --packing off, drop --doc-mask, or pp=1")
    # On the meta device (init="meta", or "auto" above the threshold; a pretrained folder always) each
    # rank keeps only its stages' values (Pipeline, zeroshard/runtime/materialize.py; a folder's are read stage
    # by stage below); not yet with an hf: preset, nor a folder with tp (read whole, then cut).
    allow_meta = not cfg.model.startswith(HF_PREFIX) and (cfg.tp == 1 or not adapter.is_hf_name(cfg.model))
    model = build_model(cfg, dataset.vocab_size, mesh.device, allow_meta=allow_meta) if model is None else model
    num_params = adapter.num_params(model)
    apply_tensor_parallel(cfg, model, mesh)  # cfg.tp > 1: split the blocks on the stage's tp dim, then cut
    # An ep dim: every MoE layer keeps this rank's experts (its stage's ep group routes the tokens);
    # without one, the routers' load-balancing counts are still summed over the stage's batch.
    apply_expert_parallel(cfg, model, mesh)
    options = engine_options(cfg, **{k: shard_overrides.pop(k) for k in ENGINE_OPTION_NAMES if k in shard_overrides})
    # A cp dim: every block's attention exact over the stage's split sequences, before the model is cut.
    cp = apply_context_parallel(model, mesh, cfg.cp_attention)
    pipe = Pipeline(model, mesh=mesh, stage=cfg.stage, schedule=cfg.pp_schedule, microbatches=cfg.microbatches,
                    stages_per_rank=cfg.pp_stages_per_rank, mp=mixed_precision(cfg), options=options,
                    comm=CommQuant.parse(cfg.comm_quant, cfg.comm_quant_block),
                    compile=cfg.compile.backend if cfg.compile.enabled else None, blocks=cfg.pipeline.blocks or None,
                    **{**adapter.shard_kwargs(model), **shard_overrides})
    for module in pipe.modules:  # a pretrained folder on meta: each stage reads only its own tensors
        adapter.after_shard(module, whole=model, tied=pipe.tied_copies)
    pipe.check_batch(cfg.batch // mesh.dp_size // cfg.accum)
    opts = [sharded_optimizer(cfg.optimizer, module, lr=cfg.lr, weight_decay=cfg.weight_decay) for module in pipe.modules]
    configure_guard(cfg, pipe.modules)
    sampler = make_sampler(cfg, dataset, mesh)
    # fp16: one scaler over all of this rank's stages, its overflow flag agreed over the world (every pp rank).
    scaler = zs_ShardedGradScaler(pipe.modules) if cfg.mp == "fp16" else None
    for module in pipe.modules:  # the step and the loss read a stage's split as the model's
        share_context(module, cp)
    return Run(cfg=cfg, mesh=mesh, model=pipe.modules[0], opt=Each(opts),
               scheduler=Each([make_scheduler(cfg, o) for o in opts]), scaler=scaler, dataset=dataset, sampler=sampler,
               model_cfg=getattr(model, "cfg", None), num_params=num_params, pipeline=pipe)


# --------------------------------------------------------------------------- the step


def global_token_count(targets: torch.Tensor, mesh: Any = None) -> torch.Tensor:
    """Tokens that carry a loss (targets != -100) in the whole global batch of ``mesh`` (the
    default one unless given), on every rank: summed over the dp group, which spans the cp ranks
    (each holding other tokens of its samples), so every token is counted once."""
    mesh = mesh or get_mesh()
    count = (targets != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
    all_reduce(count, op="sum", group=mesh.dp_name, phase=METRICS_PHASE, mesh=mesh)
    return count


def accumulate_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, accum: int,
                         scaler: Any = None, micro: Micro | None = None,
                         positions: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Forward/backward over `accum` micro-batches; returns this rank's summed token loss and the
    bytes of the token-count all-reduce.

    Every micro-step backpropagates `loss_sum * world / global_tokens`: the runtime averages
    over ranks (divides by world), so the gradient is exactly the mean over every loss-carrying
    token of the global batch, however unevenly masked tokens fall across micro-batches and ranks.
    Only the last micro-step synchronises; the others run under `zs.no_sync`. ``positions`` (packed
    samples' position_ids, or None) are cut into micro-batches with the rows.
    """
    mesh = mesh_of(model)  # the batch is split over the data-parallel ranks of the model's own mesh
    cp = context_of(model)
    if cp is not None:  # a cp rank trains its tokens of the same samples; the count below sums over cp too
        x, y = cp.split(x), cp.split(y)
    count = global_token_count(y, mesh)
    norm = mesh.dp_size / count
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    pairs = list(zip(x.chunk(accum), y.chunk(accum)))
    cuts = positions.chunk(accum) if positions is not None else [None] * len(pairs)
    for index, ((xm, ym), pm) in enumerate(zip(pairs, cuts)):
        last = index == len(pairs) - 1
        with contextlib.nullcontext() if last else no_sync(model), \
                micro(index) if micro is not None else contextlib.nullcontext():
            if cp is not None:  # packed samples: the attention masks by the whole rows' documents
                pm = cp.pack(pm)
            with phase("forward"):
                loss_sum, _ = adapter.loss_sum(model, xm, ym, pm)
            scaled = loss_sum * norm.to(loss_sum.dtype)
            with phase("backward"):
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
        total += loss_sum.detach().double()
    return total, count.numel() * count.element_size()


def optimizer_step(model: torch.nn.Module, opt: Any, *, clip: float, scaler: Any = None, scheduler: Any = None,
                   before_zero_grad: Callable[[], None] | None = None) -> float | None:
    """Unscale (fp16), clip on the global norm, step unless any rank overflowed, advance the LR
    schedule (once per optimizer step, never per micro-step), then zero the grads."""
    if scaler is not None:
        scaler.unscale_(opt)
    norm = zs_clip_grad_norm_(model, clip) if clip > 0 else None
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()  # skipped on every rank when the loss or the grad norm is not finite (runtime/guard.py)
    # A step the guard skipped leaves the LR schedule where it was: as if its batch had never come.
    if scheduler is not None and (scaler is not None or not skipped(model)):
        scheduler.step()
    if before_zero_grad is not None:
        before_zero_grad()
    opt.zero_grad()
    # The norm is logged on the host: the step's one deliberate sync outside the scaler's check (the
    # non-finite guard read it with its flag when it decided the step).
    return None if norm is None else logged_norm(model, norm)


def logged_norm(model: torch.nn.Module, norm: torch.Tensor) -> float:
    """The step's grad norm on the host: as the guard read it, else one read of its own."""
    value = guard.norm_value(get_engine(model))
    return value if value is not None else float(host_sync.item(norm, "step.grad_norm", fake_value=0.0))


def one_step(model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, *, accum: int = 1,
             clip: float = 0.0, scaler: Any = None, scheduler: Any = None, micro: Micro | None = None,
             before_zero_grad: Callable[[], None] | None = None,
             positions: torch.Tensor | None = None) -> StepOutcome:
    """One optimizer step of a `zs.shard` model on this rank's slice (`x`, `y`) of the global batch."""
    loss_sum, metric_bytes = accumulate_gradients(model, x, y, accum=accum, scaler=scaler, micro=micro,
                                                  positions=positions)
    guard.note_loss(get_engine(model), loss_sum)  # a non-finite loss on any rank skips the step too
    with phase("optimizer"):
        norm = optimizer_step(model, opt, clip=clip, scaler=scaler, scheduler=scheduler,
                              before_zero_grad=before_zero_grad)
    return StepOutcome(loss_sum=loss_sum, grad_norm=norm, metric_bytes=metric_bytes)


def pipeline_step(run: Run, x: torch.Tensor, y: torch.Tensor) -> StepOutcome:
    """One optimizer step of a pipeline run: `accum` runs of the schedule, every microbatch's grads
    accumulated unreduced, then one reduction, clipping over every stage, and each stage's optimizer
    and LR schedule once. The loss and grads are the global-batch mean, as in `accumulate_gradients`."""
    pipe, cfg, scaler = run.pipeline, run.cfg, run.scaler
    cp = context_of(run.model)
    if cp is not None:  # a cp rank's stages run its tokens of the same samples; the count spans cp
        x, y = cp.split(x), cp.split(y)
    count = global_token_count(y, run.mesh)  # over the stage's data-parallel ranks: the same on every stage
    scale = run.mesh.dp_size / count * (scaler.get_scale() if scaler is not None else 1.0)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for xm, ym in zip(x.chunk(cfg.accum), y.chunk(cfg.accum)):
        with phase("pipeline"):
            total += pipe.run(xm, ym, loss_scale=scale)
    with phase("backward"):
        pipe.reduce()
    with phase("optimizer"):
        if scaler is not None:
            scaler.unscale_(run.opt)  # one overflow flag for every stage: all skip, or none
        norm = pipe.clip_grad_norm_(cfg.clip) if cfg.clip > 0 else None
        if scaler is not None:
            scaler.step(run.opt)
            scaler.update()
        else:
            # One non-finite flag for every stage of every pp rank, from the whole model's norm. The loss,
            # which only the last stage computed, joins it as 0 x loss: a non-finite loss there skips the
            # step on every stage even when the grads it left are finite.
            if cfg.skip_nonfinite:
                flag = norm if norm is not None else pipe.grad_norm()
                guard.decide_for([get_engine(m) for m in pipe.modules], flag + total.to(flag.dtype) * 0.0)
            run.opt.step()
        if scaler is not None or not skipped(run.model):
            run.scheduler.step()
        run.opt.zero_grad()
    loss_sum = pipe.pp_sum(total)  # only the last stage computed it
    metric_bytes = count.numel() * count.element_size() + loss_sum.element_size()
    run.metric_bytes += metric_bytes
    grad_norm = None if norm is None else logged_norm(run.model, norm)
    return StepOutcome(loss_sum=loss_sum, grad_norm=grad_norm, metric_bytes=metric_bytes)


def step(run: Run, x: torch.Tensor, y: torch.Tensor, *, micro: Micro | None = None,
         before_zero_grad: Callable[[], None] | None = None, positions: torch.Tensor | None = None) -> StepOutcome:
    """One optimizer step of `run`, with its config's accumulation, clipping, scaler and schedule.
    ``positions``: the packed samples' position_ids of the rows, or None."""
    if run.pipeline is not None:
        if positions is not None:
            raise ValueError("packed samples need pp=1 (a pipeline stage takes no position_ids yet)")
        if micro is not None or before_zero_grad is not None:
            raise ValueError("micro and before_zero_grad hooks do not apply to a pipeline step (pp > 1)")
        return pipeline_step(run, x, y)
    out = one_step(run.model, run.opt, x, y, accum=run.cfg.accum, clip=run.cfg.clip, scaler=run.scaler,
                   scheduler=run.scheduler, micro=micro, before_zero_grad=before_zero_grad, positions=positions)
    run.metric_bytes += out.metric_bytes
    return out


# --------------------------------------------------------------------------- a peer's step


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
               autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The step a plain PyTorch user writes (mean loss, backward, step, zero_grad), for the peers a
    benchmark holds zeroshard against (one process, torch DDP, FSDP2). Not zeroshard's step: it is
    here so that every step any tool times is written in this one module. Returns the loss."""
    device_type = x.device.type
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()
