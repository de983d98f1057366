"""``zs.plan``: one call from a model, a config, a preset name or a bare parameter count to a Plan."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from zeroshard.comm.dims import ParallelDims
from zeroshard.comm.quant import CommQuant
from zeroshard.tools.planner.context import cp_shape, with_exchange
from zeroshard.parallel.cp.volume import schedule_sizes
from zeroshard.runtime.schedule_events import ContextParallelSizes
from zeroshard.tools.planner.activations import ActivationEstimate, gpt_activations
from zeroshard.tools.planner.comm import Collective
from zeroshard.tools.planner.experts import ExpertSplit, expert_split
from zeroshard.tools.planner.inventory import Inventory, meta_gpt
from zeroshard.tools.planner.memory import Estimator
from zeroshard.tools.planner.owner_state import per_tensor_params
from zeroshard.tools.planner.result import LayoutPlan, Plan
from zeroshard.tools.planner.spec import PlanSpec, parse_count, resolve_mp, resolve_optimizer
from zeroshard.tools.planner.tp import TensorParallel, layer_collectives
from zeroshard.tools.planner.variants import variants
from zeroshard.runtime.options import KNOB_NAMES, EngineOptions
from zeroshard.runtime.precision import MixedPrecision
from zeroshard.runtime.wrap import UnitsArg

_ANALYTIC_SEQ = 2048  # shown only: a bare count has no activations to scale


def _is_count(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    if isinstance(value, str):
        try:
            parse_count(value)
        except ValueError:
            return False
        return True
    return False


def plan_dims(world: int, *, pp: int = 1, tp: int = 1, shard_size: int | None = None, ep: int = 1,
              cp: int = 1) -> ParallelDims:
    """The layout a plan is asked for: ``world`` is one pipeline stage's ranks (every rank without pp)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be a positive int, got {pp!r}")
    return ParallelDims.of(world * pp, pp=pp, tp=tp, shard=shard_size, ep=ep, cp=cp)
def _shape(model_or_config: Any) -> Any:
    """The simulator's ``Shape`` when ``model_or_config`` is one or names one (llama3-8b), else None:
    the one description of a transformer the planner and the simulator both read."""
    from zeroshard.tools.sim.workload import SHAPES, Shape

    if isinstance(model_or_config, Shape):
        return model_or_config
    return SHAPES.get(model_or_config) if isinstance(model_or_config, str) else None


def _resolve_model(model_or_config: Any, seq: int | None) -> tuple[nn.Module, str, Any, int]:
    """(model, name, GPTConfig or None, seq). Configs, shapes and names are built on the meta device."""
    from zeroshard.models import GPT, GPTConfig
    from zeroshard.tools.sim.workload import DEFAULT_SEQ, meta_module

    cfg: GPTConfig | None
    if (shape := _shape(model_or_config)) is not None:
        return meta_module(shape), shape.name, None, seq or DEFAULT_SEQ
    if isinstance(model_or_config, str):
        cfg = GPTConfig.named(model_or_config, **({"seq_len": seq} if seq else {}))
        return meta_gpt(cfg), model_or_config, cfg, cfg.seq_len
    if isinstance(model_or_config, GPTConfig):
        cfg = dataclasses.replace(model_or_config, seq_len=seq) if seq else model_or_config
        return meta_gpt(cfg), "GPT", cfg, cfg.seq_len
    if isinstance(model_or_config, nn.Module):
        cfg = model_or_config.cfg if isinstance(model_or_config, GPT) else None
        if cfg is not None and seq is not None and seq > cfg.seq_len:
            raise ValueError(f"seq {seq} exceeds the model's seq_len {cfg.seq_len}; plan a model built with "
                             f"seq_len >= {seq} or a shorter seq")
        seq = seq or (cfg.seq_len if cfg is not None else _ANALYTIC_SEQ)
        return model_or_config, type(model_or_config).__name__, cfg, seq
    raise ValueError(f"cannot plan {type(model_or_config).__name__}: pass an nn.Module, a GPTConfig, a preset name "
                     "(tiny, small, medium) or a parameter count such as 7e9")


def _gpt_activations_and_tp(cfg, inventory: Inventory, spec: PlanSpec, split: TensorParallel,
                            gpus_per_node: int | None) -> tuple[ActivationEstimate, tuple[Collective, ...]]:
    """Our GPT's activations per rank and its tp collectives per step (none at tp=1). Its cp
    exchanges are the step schedule's (``_cp_sizes``)."""
    compute = spec.mp.compute_dtype(next(iter(inventory.dtypes)))
    c = torch.empty(0, dtype=compute).element_size()
    activations = gpt_activations(cfg, micro_batch=spec.micro_batch, seq=spec.seq // spec.cp, compute_bytes=c,
                                  policy=spec.checkpointing, tp=split.tp, sequence_parallel=split.sequence_parallel,
                                  skew=spec.routing_skew, routed_tokens=inventory.experts.routed_tokens(spec.tokens))
    if spec.cp > 1:  # a rank's tokens are seq / cp of each sequence; one layer's exchange runs at a time
        shape = cp_shape(cp=spec.cp, rows=spec.micro_batch, seq=spec.seq, q_width=cfg.n_embd // split.tp,
                         kv_width=cfg.n_embd // split.tp, elem=c)
        activations = with_exchange(activations, spec.cp_attention, shape)
    tp_comm = layer_collectives(split, layers=cfg.n_layer, tokens=spec.tokens, width=cfg.n_embd, compute_bytes=c,
                                micro_steps=spec.accum, gpus_per_node=gpus_per_node,
                                norm_vectors=2 * (2 if cfg.bias else 1),  # ln1, ln2: weight (and bias)
                                rebuilt_layers=sum(b - a for a, b in activations.segments),
                                segments=len(activations.segments))
    return activations, tp_comm


def _cp_sizes(cfg: Any, inventory: Inventory | None, spec: PlanSpec, split: TensorParallel) -> ContextParallelSizes | None:
    """Our GPT's attention exchanges per block under cp, as the runtime's step schedule lists them."""
    if cfg is None or inventory is None or spec.cp == 1:
        return None
    compute = spec.mp.compute_dtype(next(iter(inventory.dtypes)))
    return schedule_sizes(spec.cp_attention, blocks=cfg.n_layer, dtype=compute, cp=spec.cp, rows=spec.micro_batch,
                          seq=spec.seq, q_width=cfg.n_embd // split.tp, kv_width=cfg.n_embd // split.tp)


def _shape_activations(shape: Any, inventory: Inventory, spec: PlanSpec) -> ActivationEstimate:
    """A Llama shape's activations per rank, as the simulator counts them for the same workload."""
    from zeroshard.tools.sim.workload import Workload, activation_estimate

    c = torch.empty(0, dtype=spec.mp.compute_dtype(next(iter(inventory.dtypes)))).element_size()
    w = Workload(shape=shape, micro_batch=spec.micro_batch, seq=spec.seq, compute_bytes=c,
                 checkpointing=spec.engine.checkpointing, accum=spec.accum)
    return activation_estimate(w, tp=spec.tp)


def _traced(model: nn.Module, inventory: Inventory, spec: PlanSpec, split: TensorParallel) -> ActivationEstimate:
    """Any other model's activations per rank, read from one traced forward (traced.py); under tp,
    a rank's part of what the model's plan splits (tp_flow.py)."""
    from zeroshard.tools.planner.traced import traced_activations

    blocks = [(s.name, s.module) for s in inventory.specs if not s.is_root]
    compute = spec.mp.compute_dtype(next(iter(inventory.dtypes)))
    return traced_activations(model, blocks, micro_batch=spec.micro_batch, seq=spec.seq, compute=compute,
                              policy=spec.checkpointing, **_flowed(split))


def _flowed(split: TensorParallel) -> dict[str, Any]:
    """The trace's tp arguments: the model's plan, followed through the forward (not under sequence
    parallelism, whose stream split the trace does not follow: the whole rank's figure is kept)."""
    if split.tp == 1 or split.plan is None or split.sequence_parallel:
        return {}
    return {"tp": split.tp, "tp_plan": split.plan}


def _traced_tp_collectives(split: TensorParallel, act: ActivationEstimate, spec: PlanSpec,
                           gpus_per_node: int | None) -> tuple[Collective, ...]:
    """A traced model's tp collectives per step: Megatron's per layer, over its block input's bytes
    (the residual stream every row-wise split reduces)."""
    layers = len(act.block_names)
    return layer_collectives(split, layers=layers, tokens=spec.tokens, width=1, compute_bytes=act.boundary // spec.tokens,
                             micro_steps=spec.accum, gpus_per_node=gpus_per_node,
                             rebuilt_layers=sum(b - a for a, b in act.segments), segments=len(act.segments))


@dataclasses.dataclass
class _Counted:
    """What the plan counts: a bare parameter count, or a model's inventory and how tp and ep split it."""

    model: Any
    cfg: Any
    inventory: Inventory | None
    psi: int
    frozen: int
    seq: int
    split: TensorParallel
    experts: ExpertSplit


def _count_params(model_or_config: Any, analytic: bool, *, seq: int | None, tp: int, sequence_parallel: bool,
                  ep: int, units: UnitsArg, dims: ParallelDims, notes: list[str], whole: nn.Module | None = None
                  ) -> _Counted:
    split = TensorParallel(tp=tp, sequence_parallel=sequence_parallel)
    model, inventory, cfg = None, None, None
    experts = ExpertSplit()
    if analytic:
        if ep > 1:
            raise ValueError(f"ep={ep} splits a model's MoE layers; pass --model (tiny-moe, an HF Mixtral or "
                             "Qwen-MoE folder or hf: name), not a bare parameter count")
        psi, frozen, seq = parse_count(model_or_config), 0, seq or _ANALYTIC_SEQ
        if tp > 1:  # no layers to tell split params from replicated ones
            psi //= tp
            notes.append(f"analytic mode with tp={tp}: every param is taken as split over the tp ranks")
    else:
        model, name, cfg, seq = _resolve_model(model_or_config, seq)
        # A pipeline stage is split as its whole model is (the runtime splits the model, then cuts it):
        # its params keep the model's names, so the whole model's tp split and MoE layers name them.
        source = whole if whole is not None else model
        source_cfg = _resolve_model(whole, None)[2] if whole is not None else cfg
        if tp > 1 and source_cfg is None:  # any model with a spec: its own plan, as the runtime splits it
            split = TensorParallel.of_model(source, tp, sequence_parallel)
        if source_cfg is not None:
            # The runtime's split of these blocks: an MoE block's attention alone (zeroshard.runtime.tp).
            split = TensorParallel.of_gpt(source_cfg, tp, sequence_parallel)
            split.check_gpt(source_cfg)
        if sequence_parallel and source_cfg is not None and source_cfg.n_expert > 0:
            raise ValueError("sequence parallelism with an MoE model is not supported by the runtime (its MoE layer "
                             "needs the whole sequence on every tp rank); plan without sequence parallelism")
        experts = expert_split(source, ep, tp=tp)
        if whole is not None:  # the stage's own MoE layers
            experts = experts.within({n for n, _ in model.named_parameters()})
        # Each expert is sharded over the world / ep ranks that hold it (ep borrows from dp x tp).
        inventory = Inventory(model, name=name, units=units, gpt=cfg, tp=split, experts=experts,
                              dp=dims.dp, expert_dp=dims.edp)
        psi, frozen = inventory.facts.trainable, inventory.facts.frozen
    return _Counted(model=model, cfg=cfg, inventory=inventory, psi=psi, frozen=frozen, seq=seq, split=split,
                    experts=experts)


def _activations(model_or_config: Any, counted: _Counted, spec: PlanSpec, activations: ActivationEstimate | None,
                 analytic: bool, gpus_per_node: int | None, notes: list[str]
                 ) -> tuple[ActivationEstimate | None, tuple[Collective, ...]]:
    """The activation estimate (a caller's own, a GPT's, a workload shape's, or one traced forward) and the
    tp collectives that go with it."""
    cfg, inventory, split, model = counted.cfg, counted.inventory, counted.split, counted.model
    tp_comm: tuple[Collective, ...] = ()
    # A caller's own estimate (a pipeline stage's activations in flight) is taken as given.
    if activations is None and cfg is not None and inventory is not None:  # a GPT config comes with its inventory
        activations, tp_comm = _gpt_activations_and_tp(cfg, inventory, spec, split, gpus_per_node)
    elif activations is None and (shape := _shape(model_or_config)) is not None and inventory is not None:
        activations = _shape_activations(shape, inventory, spec)
    elif activations is None and analytic:
        notes.append("analytic mode: no activations or all-gather window (they need a model: --model); "
                     "workspace is the optimizer's scratch")
    elif activations is None and inventory is not None:
        try:
            activations = _traced(model, inventory, spec, split)
            notes.append("activations traced from one forward of the model on fake tensors; backward's "
                         "temporaries estimated from its largest saved tensors")
        except (TypeError, ValueError, RuntimeError, IndexError) as e:  # a module that takes no token ids
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            notes.append(f"activations not estimated: one forward on token ids failed ({first})")
        if split.tp > 1 and activations is not None:
            tp_comm = _traced_tp_collectives(split, activations, spec, gpus_per_node)
            notes.append(f"tp={split.tp}: the model's own plan splits its params; the traced activations are "
                         + ("one tp rank's (what the plan's column splits leave split, 1/tp each)" if _flowed(split)
                            else "one whole rank's (sequence parallelism not followed), so they are an upper bound"))
    return activations, tp_comm


def plan(model_or_config: Any, *, world: int, stage: int | None = None, mp: MixedPrecision | str | None = None,
         optimizer: Any = "adamw", optimizer_kwargs: dict | None = None, batch: int | None = None,
         seq: int | None = None, accum: int = 1, shard_size: int | None = None, headroom: float = 0.10,
         accounting: str | None = None, units: UnitsArg = None, device: str = "cuda",
         gpus_per_node: int | None = None, comm_quant: str = "none", comm_quant_block: int = 256,
         tp: int = 1, sequence_parallel: bool = False, ep: int = 1, routing_skew: float = 0.0,
         engine: EngineOptions | None = None, activations: ActivationEstimate | None = None,
         pp: int = 1, pipeline_order: tuple[tuple[str, int], ...] | None = None, cp: int = 1,
         cp_attention: str = "ring", whole: nn.Module | None = None, clip: float | None = None,
         **knobs: Any) -> Plan:
    """Per-rank memory of DDP and ZeRO-1/2/3 (plus hybrid/offload variants when asked) for one run.

    ``model_or_config`` is a model (real or on the meta device), a ``GPTConfig``, a preset name, or
    a parameter count (analytic mode, the ZeRO paper's textbook table). ``batch`` is the global batch per
    optimizer step (default: one sequence per rank per micro-step). ``device`` picks the backend's
    behaviour: the optimizer's default implementation (foreach on cuda, a per-tensor loop on cpu),
    which sets its scratch. Reductions complete asynchronously on both backends (NCCL's stream,
    gloo's worker threads), so the grad buffers in flight are planned the same way for both: the
    bound the engine's cap on in-flight reductions guarantees. ``tp`` splits each of our GPT's
    blocks over that many consecutive ranks (``world`` counts them all; ``world / tp`` are data
    parallel); see zeroshard/tools/planner/tp.py and docs/planner.md. ``ep`` splits an MoE model's experts
    over that many ranks of dp × tp, each expert sharded over the ``world / ep`` that hold it;
    ``routing_skew`` is the busiest ep rank's extra share of routed rows (zeroshard/tools/planner/experts.py,
    docs/expert_parallel.md). ``cp`` splits each sequence over that many ranks (``cp_attention``
    ring or ulysses): activations are those of ``seq / cp`` tokens plus one layer's exchange, ZeRO
    shards over dp × cp, and the exchanges are the step's "cp" collectives (docs/context_parallel.md).

    The engine's knobs are the runtime's ``EngineOptions``: pass one as ``engine``, or its knobs
    flat as ``zs.shard`` and ``zeroshard train`` spell them (``checkpointing="sqrt"``,
    ``prefetch=2``, ``offload="cpu"``; the names in ``zeroshard.runtime.options.KNOB_NAMES``).

    ``clip`` is the run's grad clipping (None: ``zeroshard train``'s default); only a run that clips
    holds clipping's float64 chunk in its step.

    ``activations`` replaces the activation estimate: the pipeline planner passes what a stage keeps
    in flight under its schedule (zeroshard/tools/planner/pipeline.py), for a stage that is not a whole GPT;
    with ``pp`` and ``pipeline_order``, the order that stage's engine runs its microbatches in, and
    ``whole``, the model the stage is cut from (its tp split and MoE layers, as the runtime reads them).
    """
    unknown = sorted(set(knobs) - set(KNOB_NAMES))
    if unknown:
        raise TypeError(f"plan() got unknown keywords {unknown}; the engine's knobs are {', '.join(KNOB_NAMES)}")
    options = EngineOptions.from_flat(knobs, base=engine)
    dims = plan_dims(world, pp=pp, tp=tp, shard_size=shard_size, ep=ep, cp=cp)  # the layout, checked before anything reads it
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    analytic = _is_count(model_or_config)
    if analytic and accounting == "runtime":
        raise ValueError("runtime accounting needs the model's layout; pass a model, config or preset name, "
                         "or use accounting='textbook' with a bare parameter count")
    optim_cls = resolve_optimizer(optimizer)
    kwargs = dict(optimizer_kwargs or {})
    notes: list[str] = []
    counted = _count_params(model_or_config, analytic, seq=seq, tp=tp, sequence_parallel=sequence_parallel, ep=ep,
                            units=units, dims=dims, notes=notes, whole=whole)
    model, inventory, psi, frozen, seq = counted.model, counted.inventory, counted.psi, counted.frozen, counted.seq
    spec = PlanSpec(dims=dims, stage=stage, mp=resolve_mp(mp, analytic=analytic), optimizer=optim_cls,
                    optimizer_kwargs=kwargs, batch=batch or dims.dp * accum, seq=seq, accum=accum,
                    engine=options, headroom=headroom,
                    accounting=accounting or ("textbook" if analytic else "runtime"),
                    comm_quant=comm_quant, comm_quant_block=comm_quant_block,
                    sequence_parallel=sequence_parallel, routing_skew=routing_skew, pipeline_order=pipeline_order,
                    cp_attention=cp_attention, **({} if clip is None else {"clip": clip}))
    activations, tp_comm = _activations(model_or_config, counted, spec, activations, analytic, gpus_per_node, notes)
    per_tensor = per_tensor_params(model, optim_cls, kwargs) if inventory is not None else None
    if per_tensor is not None:
        notes.append(f"{per_tensor.recipe}: {len(per_tensor.classes)} params step whole on owner ranks (the runtime's "
                     "balance); each rank's state is its owned params' plus the elementwise class's on the rest "
                     "of its shard; the owner exchange's whole-param temporaries are not counted")
    if spec.offload != "none":
        notes.append(f"{spec.offload} offload keeps masters, optimizer state and the reduced grads off the device "
                     f"({'host memory' if spec.offload == 'cpu' else 'files'}), and steps there"
                     + ("; on a CPU run host and device are one memory" if device == "cpu" else ""))
    foreach = kwargs.get("foreach")
    by_units = None if spec.accounting == "textbook" else inventory
    # With units, the step schedule sends what the runtime quantizes itself; a bare count splits the
    # textbook volumes afterwards (_with_comm_quant).
    comm = CommQuant.parse(spec.comm_quant, spec.comm_quant_block) if by_units is not None else None
    estimator = Estimator(spec, inventory=by_units, psi=psi,
                          frozen=frozen, activations=activations,
                          foreach=(device == "cuda") if foreach is None else bool(foreach),
                          gpus_per_node=gpus_per_node, reduce_in_place=device == "cpu",
                          host_is_device=device == "cpu", tp_collectives=tp_comm, comm_quant=comm, experts=counted.experts,
                          per_tensor=per_tensor, cp_sizes=_cp_sizes(counted.cfg, inventory, spec, counted.split))
    layouts = {v.name: estimator.layout(v) for v in variants(spec)}
    if spec.comm_quant != "none":
        layouts = _with_comm_quant(layouts, spec, inventory, psi + frozen, notes, textbook=by_units is None)
    return Plan(spec=spec, mode="analytic" if analytic else "model", model=inventory.facts if inventory else None,
                params=psi + frozen, trainable=psi, optimizer_cost=tuple(estimator.costs.values()),
                activations=activations, layouts=layouts, notes=tuple(notes))


def _with_comm_quant(layouts: dict[str, LayoutPlan], spec: PlanSpec, inventory: Inventory | None, params: int,
                     notes: list[str], *, textbook: bool) -> dict[str, LayoutPlan]:
    """Every layout with the error-feedback residual the runtime would have there and, for the
    ``textbook`` volumes, the quantized traffic (a layout planned from units has it already)."""
    from zeroshard.tools.planner import quant

    comm = CommQuant.parse(spec.comm_quant, spec.comm_quant_block)
    dtype = next(iter(inventory.dtypes)) if inventory else torch.float32
    sizes = dict(compute_bytes=torch.empty(0, dtype=spec.mp.compute_dtype(dtype)).element_size(),
                 reduce_bytes=torch.empty(0, dtype=spec.mp.reduction_dtype(dtype)).element_size())
    out = {}
    for name, layout in layouts.items():
        groups = (quant.groups_of(inventory, stage=layout.stage, shards=layout.shard_size,
                                  bucket_bytes=spec.engine.bucket_bytes) if inventory is not None
                  else quant.analytic_groups(params, layout.shard_size))
        out[name] = quant.apply(layout, comm, groups, textbook=textbook, **sizes)
    notes.append(f"comm_quant={spec.comm_quant}: int8 + one fp32 scale per {comm.block_size} elements on the wire "
                 "where the runtime quantizes (weights at stage 3, grads at stages 2-3)"
                 + ("; grads include error feedback's fp32 residual" if comm.error_feedback else ""))
    return out
