"""``--measure``: run the planned config for real and read what it allocated, component by component.

Each stage runs on a fresh model in one gloo world (``zeroshard.launch.spawn``). Step 1 is a warm-up:
it creates the optimizer state and records stage 3's unit order, so step 2 is the steady state the
plan describes. During step 2:

- params, master, grads and optimizer state are read from the storages themselves
  (``untyped_storage().nbytes()``, each storage once), not from bookkeeping;
- activations are the storages autograd saves for backward (``saved_tensors_hooks``), params excluded;
- buckets are the full-size grads in flight during backward beyond the ones kept for the step
  (stages 2-3: per-param grads waiting for their unit and the flat buffers they are collected into;
  cast copies fed to a reduction), sampled after every grad hook and at the engine's
  grads_collected and reduce_launched events, where they peak (``_GradSampler``);
- the engine runs with ``reap_when_done=False``: a reduction is finished only when the in-flight
  cap or a read forces it, so the step reaches the bound the plan predicts instead of whatever the
  timing of that run allows (see ``EngineOptions.reap_when_done``);
- the window is the engine's own storage-based peak of gathered full params (stage 3);
- the total is the peak of live storage over the whole step from torch's ``MemTracker`` on CPU, or
  ``torch.cuda.max_memory_allocated`` on CUDA. Workspace is what the total leaves unexplained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from typing import Any

import torch

from zeroshard.plan.result import COMPONENTS, MODEL_STATES, Components, Plan
from zeroshard.plan.spec import STAGE_NAMES
from zeroshard.sharding.events import EventKind
from zeroshard.sharding.reduce import PieceReduction

MEASURED = ("params", "grads", "master", "optimizer", "activations", "window", "buckets")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComponentCheck:
    layout: str
    predicted: Components
    measured: dict[str, int]
    """Per component, the worst rank's bytes; ``workspace`` is the residual (total less the other
    measured terms), which compares with the plan's workspace less its overlap."""
    measured_total: int
    method: str

    @property
    def model_state_error(self) -> float:
        measured = sum(self.measured[n] for n in MODEL_STATES)
        return abs(self.predicted.model_states - measured) / max(measured, 1)

    @property
    def total_error(self) -> float:
        """Against the allocated peak: CPU storage accounting has no allocator to need headroom."""
        return abs(self.predicted.allocated - self.measured_total) / max(self.measured_total, 1)


def _storages(tensors) -> dict[int, int]:
    """data_ptr -> nbytes for each distinct, non-empty storage."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in out:
            out[st.data_ptr()] = st.nbytes()
    return out


class _GradSampler:
    """Peak bytes of full-size grad memory in flight besides the grads the step keeps.

    That is: stages 2-3's per-param grads waiting on ``param.grad`` for the rest of their unit, the
    flat buffers they are collected into (until the reduction is reaped), a cast copy fed to a
    reduction, and a reduction's output while it is a second shard (added into an existing one, or
    cast to the master dtype). Stages 0-1's persistent flat grads, and the shards the reductions
    leave, are the ``grads`` component.

    Sampled after every grad hook (this hook is registered after the engine's, so it runs after it),
    and at the engine's events where the peaks are: grads_collected (a unit's flat buffer is filled
    and every per-param grad is still alive) and reduce_launched (a reduction has just been issued,
    before the engine reaps the previous one).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.peak = 0
        self.handles = [p.register_post_accumulate_grad_hook(self.sample)
                        for g in engine.trainable_groups for p in g.params]
        self.handles.append(engine.events.subscribe(
            self.sample, kinds=(EventKind.GRADS_COLLECTED, EventKind.REDUCE_LAUNCHED)))

    def sample(self, *_: Any) -> None:
        transient, kept = [], set()
        for g in self.engine.trainable_groups:
            if g.grad_full is not None and not g.policy.transient_grads:
                kept.add(g.grad_full.untyped_storage().data_ptr())
            elif g.grad_full is not None:
                transient.append(g.grad_full)
            if g.policy.transient_grads:
                # Waiting for the rest of the unit; at stages 0-1 param.grad is a view of the kept buffer.
                transient.extend(p.grad for p in g.params or () if p.grad is not None)
            # A cast copy fed to the reduction is transient, unless it is also the reduction's output
            # (stage 0 all-reduces in place), which becomes the grads the step reads.
            flight, reduced = g.reducer.in_flight, None
            if isinstance(flight, PieceReduction):  # gloo reduces the grads in place, piece by piece
                transient.extend(piece.tensor for piece in flight.pieces)
            elif flight is not None:
                reduced = flight.output
                if flight.source is not reduced:
                    transient.append(flight.source)
            shard = g.peek_grad_shard()
            if reduced is not None and g.policy.shard_optimizer and reduced is not shard and (
                    shard is not None or reduced.dtype != g.master_dtype):
                transient.append(reduced)  # added into the existing shard, or cast to the master dtype, then dropped
        live = _storages(transient)
        self.peak = max(self.peak, sum(v for k, v in live.items() if k not in kept))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def _saved_activations(engine, sink: dict[int, int]):
    def param_ptrs() -> set[int]:
        return {t.untyped_storage().data_ptr() for g in engine.groups for t in (g.full, g.shard)}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in param_ptrs():
            sink.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _peak_tracker(device: torch.device, externals: list):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return contextlib.nullcontext(), lambda: torch.cuda.max_memory_allocated(), "cuda max_memory_allocated"
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*[e for e in externals if e is not None])

    def peak() -> int:
        return max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())

    return tracker, peak, "storage accounting (torch MemTracker)"


def _measure_stage(cfg, stage: int, req: dict) -> dict:
    import zeroshard as zs
    from zeroshard.models import GPT
    from zeroshard.sharding import get_engine
    from zeroshard.step import one_step

    mesh = zs.get_mesh()
    torch.manual_seed(0)
    # reap_when_done=False: the engine reaps (frees) a reduction's buffers as soon as it completes,
    # which on gloo's worker threads or NCCL's stream depends on timing (in one run a unit's flat
    # grads are gone before the next unit collects its own, in another not; seen on rank 0 and not
    # rank 1 of one run). The engine guarantees the bound at max_inflight_reductions, the plan
    # predicts it, and this makes the measured step reach it every time, as a link slower than
    # compute would. A reduction that finishes sooner only lowers the peak.
    options = zs.EngineOptions(prefetch=req["prefetch"], reshard_after_forward=req["reshard_after_forward"],
                               bucket_mb=req["bucket_mb"], accumulation=req["accumulation"], reap_when_done=False)
    model = zs.shard(GPT(cfg).to(mesh.device), stage=stage, mp=req["mp"], options=options)
    engine = get_engine(model)
    opt = zs.optimizer(model, req["optimizer"], **req["optimizer_kwargs"])
    gen = torch.Generator().manual_seed(1000 + mesh.rank)
    # The rank's whole slice, as training holds it; the step cuts it into `accum` micro-batches.
    rows = req["micro_batch"] * req["accum"]
    x = torch.randint(0, cfg.vocab_size, (rows, req["seq"]), generator=gen).to(mesh.device)
    y = torch.randint(0, cfg.vocab_size, (rows, req["seq"]), generator=gen).to(mesh.device)

    def micro_hooks(activations: dict[str, int] | None, tracker=None):
        @contextlib.contextmanager
        def micro(index: int):
            if index and hasattr(tracker, "reset_mod_stats"):
                tracker.reset_mod_stats()  # MemTracker refuses a second forward otherwise; peaks stay
            saved: dict[int, int] = {}
            with _saved_activations(engine, saved) if activations is not None else contextlib.nullcontext():
                yield
            if activations is not None:  # per micro-step: each backward frees what its forward saved
                activations["peak"] = max(activations.get("peak", 0), sum(saved.values()))
        return micro

    # Warm-up: optimizer state exists and stage 3 has its unit order.
    one_step(model, opt, x, y, accum=req["accum"], micro=micro_hooks(None))
    gc.collect()

    engine.reset_memory_stats()
    groups = engine.groups
    externals = [model, opt, x, y] + [t for g in groups for t in (g.full, g.shard, g.grad_full, g.grad_shard)]
    tracker, peak, method = _peak_tracker(mesh.device, externals)
    saved: dict[str, int] = {}  # "peak": the most activation bytes one micro-step saved
    grads: dict[int, int] = {}

    def read_grads() -> None:
        # Read after the optimizer step, when every reduction has finished: were one still pending (an
        # engine may leave the last ones to the step), reading its shard would wait for it and change
        # the step being measured. The step frees no grads; zeroing them comes after this.
        grads.update(_storages([t for g in groups for t in (g.grad_full, g.grad_shard)]))

    sampler = _GradSampler(engine)
    with tracker, warnings.catch_warnings():
        # MemTracker's grad hook can read param.grad after the engine has moved it into the flat
        # buffer (stages 2-3 leave None there); it warns and skips, which is right: the buffer is tracked.
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        one_step(model, opt, x, y, accum=req["accum"], micro=micro_hooks(saved, tracker), before_zero_grad=read_grads)
    sampler.close()
    full = _storages([g.full for g in groups]) if stage < 3 else {}
    own = _storages([g.shard for g in groups if g.compute_dtype == g.master_dtype]) if stage == 3 else {}
    params = {**full, **own}
    master = {k: v for k, v in _storages([g.shard for g in groups]).items() if k not in params}
    state = _storages([t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)])
    out = {
        "params": sum(params.values()), "grads": sum(grads.values()), "master": sum(master.values()),
        "optimizer": sum(state.values()), "activations": saved.get("peak", 0),
        "window": engine.peak_full_bytes if stage == 3 else 0, "buckets": sampler.peak,
        "total": int(peak()), "method": method, "max_inflight_reductions": engine.options.max_inflight_reductions,
    }
    return out


def measure_worker(req: dict) -> dict:
    """Runs on every rank: each requested stage on a fresh model, one after the other."""
    import zeroshard as zs
    from zeroshard.models import GPTConfig

    zs.init(shard_size=req["shard_size"])
    cfg = GPTConfig.from_dict(req["gpt"])
    out = {}
    for stage in req["stages"]:
        out[stage] = _measure_stage(cfg, stage, req)
        gc.collect()  # the previous stage's model and optimizer go before the next is built
    return out


def request(plan: Plan, stages: tuple[int, ...]) -> dict:
    """What the workers need, as plain picklable data; refuses what the runtime cannot run."""
    spec = plan.spec
    if plan.model is None or plan.model.gpt is None:
        raise ValueError("--measure runs zeroshard's GPT; plan a preset (--model small) or a GPTConfig")
    if spec.checkpointing.policy != "none":
        raise ValueError("activation checkpointing is planned only (the runtime does not implement it yet); "
                         "measure with checkpointing none")
    if spec.offload != "none":
        raise ValueError("offload is planned only (the runtime does not implement it yet); measure with offload none")
    if spec.accounting != "runtime":
        raise ValueError("measurement checks the runtime accounting; plan with accounting='runtime'")
    return {
        "gpt": plan.model.gpt.to_dict(), "stages": tuple(stages), "mp": spec.mp, "optimizer": spec.optimizer,
        "optimizer_kwargs": dict(spec.optimizer_kwargs), "prefetch": spec.prefetch,
        "reshard_after_forward": spec.reshard_after_forward, "bucket_mb": spec.bucket_mb,
        "micro_batch": spec.micro_batch, "seq": spec.seq, "accum": spec.accum, "shard_size": spec.shard_size,
        "accumulation": spec.accumulation,
    }


def measure(plan: Plan, stages: tuple[int, ...] = (0, 1, 2, 3), *, timeout_s: float = 600.0) -> list[ComponentCheck]:
    """Spawn ``plan.spec.world`` gloo ranks, measure each stage, and pair it with the prediction."""
    from zeroshard.launch import spawn

    per_rank = spawn(measure_worker, plan.spec.world, args=(request(plan, stages),), timeout_s=timeout_s)
    return checks(plan, per_rank)


def checks(plan: Plan, per_rank: list[dict]) -> list[ComponentCheck]:
    out = []
    for stage in per_rank[0]:
        name = STAGE_NAMES[stage] + ("_hybrid" if plan.spec.hybrid and stage > 0 else "")
        worst = {k: max(r[stage][k] for r in per_rank) for k in (*MEASURED, "total")}
        worst["workspace"] = worst["total"] - sum(worst[k] for k in MEASURED)
        out.append(ComponentCheck(layout=name, predicted=plan[name].device,
                                  measured={k: worst[k] for k in COMPONENTS if k in worst},
                                  measured_total=worst["total"], method=per_rank[0][stage]["method"]))
    return out
