"""``--measure``: run the planned config for real and read what it allocated, component by component.

Each stage runs on a fresh model in one gloo world (``zeroshard.trainer.launch.spawn``). Step 1 is a warm-up:
it creates the optimizer state and records stage 3's unit order, so step 2 is the steady state the
plan describes. During step 2:

- params, master, grads and optimizer state are read from the storages themselves
  (``untyped_storage().nbytes()``, each storage once), not from bookkeeping;
- activations are the storages autograd saves for backward (``saved_tensors_hooks``), params excluded,
  plus the block inputs still alive when forward returns: a checkpoint segment keeps its input
  outside autograd's saved tensors, to rebuild from (``_kept_block_inputs``). What a segment
  rebuilds in backward is not told apart: it is in the total, and so in the residual;
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
- offloaded (``offload="cpu"``), the masters, the optimizer state and the reduced grad shards are
  host bytes, reported apart. On CPU host and device are one memory, so the total holds both and is
  compared with the plan's ``combined_peak``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.tools.harness import slowest_median, timed
from zeroshard.tools.planner.result import COMPONENTS, MODEL_STATES, Components, Plan
from zeroshard.tools.planner.spec import STAGE_NAMES
from zeroshard.runtime.events import EventKind

if TYPE_CHECKING:
    from zeroshard.trainer.targets import Target

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
    predicted_peak: int = 0
    """The plan's figure the measured total compares with: the allocated peak, or device and host
    together where the measurement counts both (offload on CPU)."""
    predicted_host: int = 0
    measured_host: int = 0
    """Offloaded: masters, optimizer state and reduced grads off the device (0 otherwise)."""
    predicted_kept: int | None = 0
    """Activations kept for backward (``ActivationEstimate.saved``), what ``measured["activations"]``
    reads; the plan's ``activations`` also counts the segment a checkpointed backward rebuilds.
    None where the plan has no activation estimate (a model other than zeroshard's GPT)."""
    step_s: float | None = None
    """Median over the timed steps of the slowest rank's step, in seconds (None: none timed). The
    steps run as measured (``reap_when_done=False``, on gloo here), outside any tracking."""

    @property
    def model_state_error(self) -> float:
        measured = sum(self.measured[n] for n in MODEL_STATES)
        return abs(self.predicted.model_states - measured) / max(measured, 1)

    @property
    def total_error(self) -> float:
        """Against the allocated peak: CPU storage accounting has no allocator to need headroom."""
        predicted = self.predicted_peak or self.predicted.allocated
        return abs(predicted - self.measured_total) / max(self.measured_total, 1)


def _storage(t: torch.Tensor):
    """``t``'s storage; a DTensor's (a tp split param or activation) is its local tensor's."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    return t.untyped_storage()


def _storages(tensors) -> dict[int, int]:
    """data_ptr -> nbytes for each distinct, non-empty storage."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = _storage(t)
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
        snapshot = self.engine.memory_snapshot()
        kept = {t.untyped_storage().data_ptr() for t in snapshot.kept_grads}
        live = _storages(snapshot.transient_grads)
        self.peak = max(self.peak, sum(v for k, v in live.items() if k not in kept))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def _saved_activations(engine, sink: dict[int, int]):
    def param_ptrs() -> set[int]:
        return {t.untyped_storage().data_ptr() for g in engine.groups for t in (g.full, g.shard)}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = _storage(t)
        if st.nbytes() and st.data_ptr() not in param_ptrs():
            sink.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


@contextlib.contextmanager
def _kept_block_inputs(model, blocks: list, sink: dict[int, int]):
    """The block inputs still alive when the model's forward returns: what checkpoint segments keep
    to rebuild from (outside autograd's saved tensors). Without checkpointing each is also saved by
    the block's first norm, so the union with the saved storages is unchanged. A Hugging Face
    decoder layer may take its hidden states by keyword, hence the first tensor of either."""
    inputs: list[weakref.ref] = []

    def remember(module, args, kwargs) -> None:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None:
            inputs.append(weakref.ref(first))

    def collect(module, args, output) -> None:
        sink.update(_storages([t for t in (r() for r in inputs) if t is not None]))
        inputs.clear()

    handles = [block.register_forward_pre_hook(remember, with_kwargs=True) for block in blocks]
    handles.append(model.register_forward_hook(collect))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _peak_tracker(device: torch.device, externals: list):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return contextlib.nullcontext(), lambda: torch.cuda.max_memory_allocated(), "cuda max_memory_allocated"
    from zeroshard.tools.planner.mem_tracker import memory_tracker

    tracker = memory_tracker()
    tracker.track_external(*[e for e in externals if e is not None])

    def peak() -> int:
        return max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())

    return tracker, peak, "storage accounting (torch MemTracker)"


def _build(req: dict, stage: int, options, mesh) -> tuple[torch.nn.Module, list, int]:
    """(sharded model, its blocks, token vocabulary): zeroshard's GPT, or the planned target built
    as ``zeroshard train`` builds it: on meta, sharded, then filled (a folder's weights read shard by
    shard, an hf: model's init replayed, a module's own reset). With a tp dim on ``mesh`` the blocks
    are split first, then with an ep dim the experts, as train splits them (a folder's blocks of
    experts read per rank)."""
    from zeroshard.parallel.experts import expert_parallel
    from zeroshard.runtime import shard as zs_shard
    from zeroshard.parallel.tp import tensor_parallel
    from zeroshard.models import GPT, GPTConfig
    from zeroshard.trainer import adapter
    from zeroshard.runtime.wrap import find_blocks

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_dict(req["gpt"])).to(mesh.device) if req["gpt"] is not None else req["target"].build()
    if req.get("lora"):  # the planned model's adapters (zeroshard.trainer.lora), on its base as train puts them
        from zeroshard.trainer.lora import inject_lora

        inject_lora(model, **req["lora"])
    blocks = [m for _, m in find_blocks(model)]  # the units zs.shard picks (no units are given)
    vocab = adapter.token_vocab(model)
    assert vocab is not None  # request() refused a model without one
    if mesh.tp_size > 1:
        tensor_parallel(model, mesh=mesh)
    if mesh.ep_size > 1:
        expert_parallel(model, mesh=mesh, values_from_folder=adapter.is_pretrained_model(model))
    zs_shard(model, stage=stage, mp=req["mp"], options=options, mesh=mesh, **adapter.shard_kwargs(model))
    adapter.after_shard(model)
    return model, blocks, vocab


def _expert_bytes_in_forward(model, engine) -> tuple[dict[str, int], list]:
    """The most expert bytes a rank holds in full while its MoE layers run: in a forward pre-hook
    of each layer's experts module, the expert params' slots in every flat group whose full buffer
    is allocated at that moment (at ep > 1 the experts' own groups; without ep, their slots in
    their block's group)."""
    from zeroshard.parallel.experts import moe_layers

    layers = moe_layers(model)
    names = {f"{layer.name}.{p}" for layer in layers for p in layer.params}
    sink: dict[str, int] = {"peak": 0}

    def read(module, args) -> None:
        held = sum(slot.numel * g.full.element_size() for g in engine.groups if g.full.untyped_storage().nbytes()
                   for slot in g.layout.slots if slot.fqn in names)
        sink["peak"] = max(sink["peak"], held)

    return sink, [layer.module.register_forward_pre_hook(read) for layer in layers]


def _optimizer(model, optim_cls: type, kwargs: dict):
    """The planned optimizer over the sharded model: Muon as the recipe ``zeroshard train`` runs
    (the hidden matrices on Muon with ``kwargs``, the rest on AdamW), any other class over every param."""
    from zeroshard.runtime import optimizer as zs_optimizer
    from zeroshard.runtime.recipes import muon_groups

    if optim_cls is torch.optim.Muon:
        return zs_optimizer(model, torch.optim.AdamW, param_groups=muon_groups(model, muon=kwargs))
    return zs_optimizer(model, optim_cls, **kwargs)


def _rank_batch(req: dict, vocab: int, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's whole slice, as training holds it; the step cuts it into `accum` micro-batches."""
    gen = torch.Generator().manual_seed(1000 + mesh.dp_rank)  # a tp group's ranks share their batch
    rows = req["micro_batch"] * req["accum"]
    x = torch.randint(0, vocab, (rows, req["seq"]), generator=gen).to(mesh.device)
    y = torch.randint(0, vocab, (rows, req["seq"]), generator=gen).to(mesh.device)
    return x, y


def _micro_hooks(engine, model, blocks, activations: dict[str, int] | None, tracker=None):
    """``one_step``'s per-micro-step context: with ``activations``, the most bytes one micro-step's
    forward saved (each backward frees what its forward saved) go to ``activations["peak"]``."""
    @contextlib.contextmanager
    def micro(index: int):
        if index and hasattr(tracker, "reset_mod_stats"):
            tracker.reset_mod_stats()  # MemTracker refuses a second forward otherwise; peaks stay
        saved: dict[int, int] = {}
        with _saved_activations(engine, saved) if activations is not None else contextlib.nullcontext(), \
                _kept_block_inputs(model, blocks, saved) if activations is not None else contextlib.nullcontext():
            yield
        if activations is not None:  # per micro-step: each backward frees what its forward saved
            activations["peak"] = max(activations.get("peak", 0), sum(saved.values()))
    return micro


def _measure_stage(stage: int, req: dict, mesh) -> dict:
    from zeroshard.runtime import get_engine
    from zeroshard.trainer.step import one_step

    # reap_when_done=False: the engine reaps (frees) a reduction's buffers as soon as it completes,
    # which on gloo's worker threads or NCCL's stream depends on timing (in one run a unit's flat
    # grads are gone before the next unit collects its own, in another not; seen on rank 0 and not
    # rank 1 of one run). The engine guarantees the bound at max_inflight_reductions, the plan
    # predicts it, and this makes the measured step reach it every time, as a link slower than
    # compute would. A reduction that finishes sooner only lowers the peak.
    options = dataclasses.replace(req["engine"], reap_when_done=False)
    offloaded = options.offload.kind != "none"
    model, blocks, vocab = _build(req, stage, options, mesh)
    engine = get_engine(model)
    opt = _optimizer(model, req["optimizer"], req["optimizer_kwargs"])
    x, y = _rank_batch(req, vocab, mesh)

    def micro_hooks(activations: dict[str, int] | None, tracker=None):
        return _micro_hooks(engine, model, blocks, activations, tracker)

    # Warm-up: optimizer state exists and stage 3 has its unit order.
    clip = req["clip"]  # the plan's: clipping's float64 chunk is in the step only when it clips
    one_step(model, opt, x, y, accum=req["accum"], clip=clip, micro=micro_hooks(None))
    gc.collect()

    engine.reset_memory_stats()
    snapshot = engine.memory_snapshot()
    externals = [model, opt, x, y, *snapshot.full_params, *snapshot.masters, *snapshot.full_grads,
                 *snapshot.grad_shards]
    tracker, peak, method = _peak_tracker(mesh.device, externals)
    saved: dict[str, int] = {}  # "peak": the most activation bytes one micro-step saved
    states: dict[str, int] = {}

    def read_grads() -> None:
        # Read after the optimizer step, when every reduction has finished: were one still pending (an
        # engine may leave the last ones to the step), reading its shard would wait for it and change
        # the step being measured. The step frees no grads; zeroing them comes after this.
        states.update(model_state_bytes(model, opt))

    sampler = _GradSampler(engine)
    experts, expert_hooks = _expert_bytes_in_forward(model, engine)
    with tracker, warnings.catch_warnings():
        # MemTracker's grad hook can read param.grad after the engine has moved it into the flat
        # buffer (stages 2-3 leave None there); it warns and skips, which is right: the buffer is tracked.
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        one_step(model, opt, x, y, accum=req["accum"], clip=clip, micro=micro_hooks(saved, tracker),
                 before_zero_grad=read_grads)
    sampler.close()
    for handle in expert_hooks:
        handle.remove()
    # Plain steps (no tracker, no hooks); the parent takes the slowest rank's per step.
    times = timed(lambda: one_step(model, opt, x, y, accum=req["accum"], clip=clip), req["timed_steps"], phase="measure",
                  device=mesh.device)
    host = {k.removeprefix("host_"): v for k, v in states.items() if k.startswith("host_")}
    out = {
        **{k: states[k] for k in MODEL_STATES}, "host": host if offloaded else {}, "activations": saved.get("peak", 0),
        "window": engine.peak_full_bytes if engine.policy.shard_params else 0, "buckets": sampler.peak,
        "total": int(peak()), "method": method, "max_inflight_reductions": engine.options.max_inflight_reductions,
        "step_times": times, "expert_held_in_forward": experts["peak"],
    }
    return out


def model_state_bytes(model, opt) -> dict[str, int]:
    """This rank's model-state bytes of a ``zs.shard`` model and its ``zs.optimizer``, read from the
    storages (each once): ``params``, ``grads``, ``master`` and ``optimizer`` on the device, and
    ``host_master``, ``host_optimizer``, ``host_grads`` when offloaded. What the plan's model states
    predict (``plan[layout].device``, ``.host``); call it after the optimizer step and before
    ``zero_grad`` (``one_step(before_zero_grad=)``), while the grads still exist. Under tensor
    parallelism the buffers hold each param's tp-local part, so the same reading checks a (shard, tp)
    plan."""
    from zeroshard.runtime import get_engine

    engine = get_engine(model)
    groups, offloaded = engine.groups, engine.store is not None
    full = _storages([g.full for g in groups]) if not engine.policy.shard_params else {}
    # Stage 3 keeps only the shard, which is the param when the dtypes agree and it is not offloaded.
    own = _storages([g.shard for g in groups if g.compute_dtype == g.master_dtype]) \
        if engine.policy.shard_params and not offloaded else {}
    params = {**full, **own}
    master = {k: v for k, v in _storages([g.shard for g in groups]).items() if k not in params}
    state = _storages([t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)])
    snapshot = engine.memory_snapshot()
    device_grads = _storages(snapshot.full_grads + ([] if offloaded else snapshot.grad_shards))
    # Offloaded, the reduced shards are the host's (unless one is the device buffer itself: stage 0
    # on CPU, where the copy to the host is a no-op).
    host_grads = {k: v for k, v in _storages(snapshot.grad_shards).items() if k not in device_grads} \
        if offloaded else {}
    out = {"params": sum(params.values()), "grads": sum(device_grads.values()),
           "master": 0 if offloaded else sum(master.values()), "optimizer": 0 if offloaded else sum(state.values())}
    if offloaded:
        out.update(host_master=sum(master.values()), host_optimizer=sum(state.values()),
                   host_grads=sum(host_grads.values()))
    return out


def measure_worker(req: dict, mesh=None) -> dict:
    """Runs on every rank: each requested stage on a fresh model, one after the other, on ``mesh``
    (default: the world's, built with the plan's shard_size, tp and ep)."""
    from zeroshard.comm.world import init as zs_init

    mesh = mesh or zs_init(shard_size=req["shard_size"], ep=req["ep"], tp=req["tp"])
    out = {}
    for stage in req["stages"]:
        out[stage] = _measure_stage(stage, req, mesh)
        gc.collect()  # the previous stage's model and optimizer go before the next is built
    return out


def measure_many_worker(reqs: list[dict]) -> list[dict]:
    """Several plans in one world (one spawn): ``measure_worker`` for each request, in order, each
    on a mesh of its (shard_size, ep, tp), built once."""
    from zeroshard.comm.world import init as zs_init, new_mesh

    def key(r: dict) -> tuple:
        return r["shard_size"], r["ep"], r["tp"]

    first = reqs[0]
    meshes = {key(first): zs_init(shard_size=first["shard_size"], ep=first["ep"], tp=first["tp"])}
    for r in reqs:
        if key(r) not in meshes:
            meshes[key(r)] = new_mesh(shard_size=r["shard_size"], ep=r["ep"], tp=r["tp"],
                                         name=f"measure-{r['shard_size'] or 'all'}-ep{r['ep']}-tp{r['tp']}")
    return [measure_worker(r, meshes[key(r)]) for r in reqs]


def request(plan: Plan, stages: tuple[int, ...], *, target: Target | None = None, timed_steps: int = 0,
            lora: dict | None = None) -> dict:
    """What the workers need, as plain picklable data; refuses what the runtime cannot run.

    A plan of zeroshard's GPT carries its config; any other model is rebuilt on each rank from
    ``target``, the --model it was planned from. ``timed_steps`` plain steps per stage are timed
    after the measured one (``ComponentCheck.step_s``). ``lora`` (zeroshard.trainer.lora.inject_lora's
    keywords) puts the adapters the plan counted on the built model."""
    spec = plan.spec
    if plan.model is None:
        raise ValueError("plan measure runs a real step of a model: pass --model (a preset, a save_pretrained folder, "
                         "hf:NAME or module:Class), not --params")
    if plan.model.gpt is None:
        if target is None:
            raise ValueError(f"measuring a plan of {plan.model.name} needs the model built again on each rank: "
                             "pass target=zeroshard.trainer.targets.Target(spec=...) (the CLI's --model)")
        _check_steppable(target, spec.seq)
    if spec.sequence_parallel:
        raise ValueError("plan measure runs tp without sequence parallelism; drop --sequence-parallel to measure")
    if spec.offload != "none" and spec.hybrid:
        raise ValueError("plan measure checks offload over the whole world; drop --shard-size or --offload")
    if spec.offload == "disk":
        raise ValueError("plan measure runs offload 'cpu' (or none): disk offload keeps its bytes in memory-mapped "
                         "files, which storage accounting cannot tell from memory")
    if spec.accounting != "runtime":
        raise ValueError("measurement checks the runtime accounting; plan with accounting='runtime'")
    if timed_steps < 0:
        raise ValueError(f"timed_steps={timed_steps} must be >= 0")
    return {
        "gpt": plan.model.gpt.to_dict() if plan.model.gpt is not None else None,
        "target": target if plan.model.gpt is None else None, "timed_steps": timed_steps, "stages": tuple(stages),
        "mp": spec.mp, "optimizer": spec.optimizer,
        "optimizer_kwargs": dict(spec.optimizer_kwargs), "engine": spec.engine,
        "micro_batch": spec.micro_batch, "seq": spec.seq, "accum": spec.accum, "clip": spec.clip,
        "shard_size": spec.shard_size,
        "ep": spec.ep, "tp": spec.tp, "lora": lora,
    }


def _check_steppable(target: Target, seq: int) -> None:
    """A training step feeds token ids of length ``seq``: refuse, before any rank starts, a model
    that embeds none or has fewer positions."""
    from zeroshard.trainer import adapter
    model = target.build()  # on meta: nothing is allocated
    if adapter.token_vocab(model) is None:
        raise ValueError(f"plan measure trains {target.spec} one step on token ids, and it embeds none (no nn.Embedding): "
                         "measure a causal LM (forward(ids) -> logits, or loss_sum(ids, targets)), or plan it "
                         "without plan measure")
    positions = adapter.max_positions(model)
    if positions is not None and seq > positions:
        raise ValueError(f"--seq {seq} is longer than the {positions} positions of {target.spec}; pass --seq {positions} "
                         "or less")


def measure(plan: Plan, stages: tuple[int, ...] = (0, 1, 2, 3), *, target: Target | None = None,
            timed_steps: int = 0, timeout_s: float = 600.0) -> list[ComponentCheck]:
    """Spawn ``plan.spec.world`` gloo ranks, measure each stage, and pair it with the prediction.
    ``target`` is the model a plan of anything but zeroshard's GPT was built from (see ``request``)."""
    from zeroshard.trainer.launch import spawn

    req = request(plan, stages, target=target, timed_steps=timed_steps)
    return checks(plan, spawn(measure_worker, plan.spec.world, args=(req,), timeout_s=timeout_s))


def checks(plan: Plan, per_rank: list[dict]) -> list[ComponentCheck]:
    out = []
    offloaded = plan.spec.offload != "none"
    for stage in per_rank[0]:
        name = STAGE_NAMES[stage] + ("_hybrid" if plan.spec.hybrid and stage > 0 else "") + \
            ("_offload" if offloaded else "")
        worst = {k: max(r[stage][k] for r in per_rank) for k in (*MEASURED, "total")}
        worst["workspace"] = worst["total"] - sum(worst[k] for k in MEASURED)
        host = max(sum(r[stage]["host"].values()) for r in per_rank)
        layout, method = plan[name], per_rank[0][stage]["method"]
        # On CPU the host is the same memory, so the measured total holds the offloaded bytes too.
        both = offloaded and not method.startswith("cuda")
        if both:
            worst["workspace"] -= host
        out.append(ComponentCheck(layout=name, predicted=layout.device,
                                  measured={k: worst[k] for k in COMPONENTS if k in worst},
                                  measured_total=worst["total"], method=method,
                                  predicted_peak=layout.combined_peak if both else layout.device.allocated,
                                  predicted_host=layout.host_bytes, measured_host=host,
                                  predicted_kept=plan.activations.saved if plan.activations else None,
                                  step_s=slowest_median([r[stage]["step_times"] for r in per_rank])))
    return out
