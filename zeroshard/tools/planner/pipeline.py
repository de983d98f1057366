"""Per-stage memory of a pipeline-parallel run, and its bubble (docs/pipeline.md, "Planning").

The model is cut as the runtime cuts it (zeroshard/parallel/pipeline/split.py, layout.py, tied.py: the
same functions, on a meta-device build; any model whose spec names its blocks), and each virtual
stage is planned by ``zs.plan`` as the
``zs.shard`` engine the runtime makes of it: its blocks as units, over the stage's world / pp
ranks, with the engine options the runtime gives a stage (zeroshard/parallel/pipeline/grad_reduce.py: at
stages 2-3 every microbatch's grads kept unreduced until the step's end, or with
``pp_grad_reduce="microbatch"`` reduce-scattered after each into the grad shard) and one planned
micro-step per microbatch. What a stage keeps for backward is counted per
microbatch (zeroshard's GPT by its formula, any other model from one forward traced on fake tensors,
each block's bytes charged to its stage) and multiplied by the microbatches its schedule holds in flight at the rank's worst
moment, read off torch's own action order (zeroshard/parallel/pipeline/order.py). torch's stages also keep
one receive buffer per microbatch for the activations (every stage but the first) and for their
grads (every stage but the last), for the whole run.

A rank with several stages (interleaved schedules) runs one engine per stage: its peak is taken
as every stage's model states plus the largest one stage's transients, with the rank's in-flight
activations charged to its first stage; the stages' transients do not peak together, so this is
the bound, not a moment.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from zeroshard.comm.dims import ParallelDims
from zeroshard.comm.mesh_build import check_composed
from zeroshard.parallel.pipeline.order import peak_in_flight, schedule_order, stage_order
from zeroshard.parallel.pipeline.shape import PipelineShape  # noqa: F401  (the planner's callers name it here)
from zeroshard.parallel.pipeline.schedules import check_checkpointing, check_microbatches, schedule_spec
from zeroshard.tools.planner.activations import ActivationEstimate, gpt_activations
from zeroshard.tools.planner.result import COMPONENTS, MODEL_STATES, Components, Plan
from zeroshard.tools.planner.spec import Checkpointing


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageRank:
    """One pp rank's plan: its stages, what it holds in flight, and every layout's bytes per rank."""

    pp_rank: int
    stages: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    """The model's block indices per stage of this rank."""
    in_flight: dict[int, int]
    """Microbatches held between forward and backward, per stage, at the rank's activation peak."""
    activation_bytes: int
    """Activations kept for backward at that moment, summed over the rank's stages."""
    buffer_bytes: int
    """torch's receive buffers (activations in, their grads back), one per microbatch, held all run."""
    plan: Plan
    """Every layout of this rank (its stages' engines together), as ``zs.plan`` reports one model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    shape: PipelineShape
    world: int
    dp: int
    """Data-parallel ranks inside each stage (replicate x shard): what its ZeRO spans."""
    micro_batch: int
    """Sequences per microbatch on one rank."""
    gpt: Any
    """The planned GPTConfig, or None for any other model (its activations traced: traced.py)."""
    batch: int
    """Global batch per optimizer step."""
    seq: int
    accum: int
    ranks: tuple[StageRank, ...]
    knobs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The engine's knobs the caller gave, flat (``pp_grad_reduce="microbatch"``): ``plan --pp
    --measure`` runs with them."""
    notes: tuple[str, ...] = ()
    name: str = "GPT"
    """The model, as the report names it."""
    layers: int = 0
    """How many blocks the stages split."""
    tp: int = 1
    ep: int = 1
    """Expert-parallel ranks each stage's MoE layers are split over."""

    @property
    def bubble(self) -> float:
        return self.shape.bubble

    def peak(self, layout: str) -> int:
        """The worst pp rank's allocated peak for ``layout``: what every device must hold."""
        return max(r.plan[layout].device.allocated for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"pipeline": self.shape.to_dict(), "world": self.world, "dp": self.dp, "tp": self.tp, "ep": self.ep,
                "micro_batch": self.micro_batch,
                "ranks": [{"pp_rank": r.pp_rank, "stages": list(r.stages), "blocks": [list(b) for b in r.blocks],
                           "in_flight": {str(k): v for k, v in r.in_flight.items()},
                           "activation_bytes": r.activation_bytes, "buffer_bytes": r.buffer_bytes,
                           "layouts": {n: lay.to_dict() for n, lay in r.plan.layouts.items()}} for r in self.ranks],
                "notes": list(self.notes)}


def _blocks_saved(est: ActivationEstimate, *, blocks: int) -> int:
    """What one microbatch's pass saves in a stage's blocks: each block's ``per_layer``, or with
    activation checkpointing each segment's input."""
    return len(est.segments) * est.boundary if est.segments else blocks * est.per_layer


def _stage_activations(cfg, est: ActivationEstimate, *, blocks: int, first: bool, last: bool, tokens: int,
                       seq: int, c: int) -> int:
    """Bytes one microbatch leaves alive on a stage from its forward to its backward.

    Its blocks save ``per_layer`` each (zeroshard/tools/planner/activations.py); with activation
    checkpointing (``est`` planned over this stage's blocks, the runtime's segments of them) each
    segment keeps only its input, ``boundary``. torch keeps the stage's
    output for the backward call: on the last stage the logits (V·c a token), with the head's own
    saved tensors (norm_f's input and output and stats, fp32 log-probs, targets); elsewhere the
    last block's output (C·c), which the next stage saves on its side. A stage after the first
    receives its input into torch's buffer, counted with the buffers, so its first block's saved
    input is not counted twice. The first stage's position ids are one row per sequence position.
    """
    C, V = cfg.n_embd, cfg.vocab_size
    out = _blocks_saved(est, blocks=blocks)
    out += tokens * (2 * C * c + 2 * c + 4 * V + 8 + V * c) if last else tokens * C * c
    if first:
        out += seq * 8
    else:
        out -= tokens * C * c
    return out


def _buffers(shape: PipelineShape, stage: int, *, one: int) -> int:
    """torch's receive buffers of one stage: per microbatch, its input (after the first stage) and
    its output's grad (before the last), ``one`` bytes each."""
    return shape.microbatches * one * ((stage > 0) + (stage < shape.num_stages - 1))


def _combine(plans: list[Plan], buffers: int, headroom: float) -> Plan:
    """One rank's layouts from its stages' plans: states summed, the largest one stage's transients
    on top, and the receive buffers (resident all run) on top of that."""
    if len(plans) == 1 and not buffers:
        return plans[0]
    layouts = {}
    for name in plans[0].layouts:
        parts = [p[name] for p in plans]
        summed = {k: sum(getattr(lay.device, k) for lay in parts) for k in COMPONENTS if k != "headroom"}
        summed["activations"] += buffers
        states = sum(summed[k] for k in MODEL_STATES)
        allocated = states + buffers + max(lay.device.allocated - lay.device.model_states for lay in parts)
        over = sum(summed.values()) - allocated
        device = Components(**summed, headroom=int(round(headroom * allocated)), overlap=max(0, over))
        layouts[name] = dataclasses.replace(
            parts[0], device=device, collectives=tuple(c for lay in parts for c in lay.collectives),
            combined_peak=sum(lay.combined_peak for lay in parts) + buffers,
            host_bytes=sum(lay.host_bytes for lay in parts))
    first = plans[0]
    return dataclasses.replace(first, params=sum(p.params for p in plans), trainable=sum(p.trainable for p in plans),
                               layouts=layouts)


def _larger(a: Plan, b: Plan) -> Plan:
    """Per layout, the memory of the moment with the higher allocated peak, and the collectives of
    ``b``, the plan of the whole step (``a`` plans its first micro-step only)."""
    layouts = {n: dataclasses.replace(max(a[n], b[n], key=lambda lay: lay.device.allocated),
                                      collectives=b[n].collectives) for n in a.layouts}
    return dataclasses.replace(b, layouts=layouts)


def _batch_split(shape: PipelineShape, *, world: int, pp: int, tp: int, batch: int | None,
                 accum: int) -> tuple[int, int, int, int]:
    """(ranks of a stage, its data-parallel ranks, the global batch, a microbatch's rows): how the
    global batch splits over a stage's data-parallel ranks, accum and the schedule's microbatches."""
    if world % (pp * tp):
        raise ValueError(f"pp {pp} x tp {tp} does not divide world {world}; each stage has world / (pp x tp) "
                         "data-parallel ranks, so pick pp and tp dividing it")
    stage_world = world // pp
    dp = stage_world // tp
    batch = batch or dp * accum * shape.microbatches
    if batch % (dp * accum):
        raise ValueError(f"global batch {batch} does not split over the {dp} data-parallel ranks of a stage x accum "
                         f"{accum}; use a multiple of {dp * accum}")
    local = batch // (dp * accum)
    check_microbatches(schedule_spec(shape.schedule), microbatches=shape.microbatches, pp=pp, local_batch=local)
    return stage_world, dp, batch, local // shape.microbatches


def plan_pipeline(model_or_config: Any, *, world: int, pp: int, pp_schedule: str = "1f1b", microbatches: int = 0,
                  pp_stages_per_rank: int = 0, batch: int | None = None, seq: int | None = None, accum: int = 1,
                  tp: int = 1, ep: int = 1, mp: Any = None, device: str = "cuda", headroom: float = 0.10,
                  **kwargs: Any) -> PipelinePlan:
    """Per pp rank, every layout's bytes (``zs.plan``'s table per stage) with the pipeline's
    activations in flight and buffers, and the bubble. ``model_or_config``: a preset name, a
    ``GPTConfig`` or zeroshard's GPT (its activations from the GPT's formula), or any model with a
    spec (a folder's or a user's, on the meta device or not: its activations traced). ``batch`` is the
    global batch per step, as ``zeroshard train --pp`` reads it. ``tp`` and ``ep`` split each stage as
    the runtime splits the whole model before cutting it: its blocks' tp plan (the traced activations
    a tp rank's part), its MoE layers' experts over the stage's ep groups (the ``ParallelDims`` of
    the run: each expert sharded over its expert-data-parallel ranks). Other keywords are ``zs.plan``'s."""
    from zeroshard.tools.planner.api import plan
    from zeroshard.tools.planner.spec import resolve_mp

    shape = PipelineShape.resolve(pp=pp, pp_schedule=pp_schedule, microbatches=microbatches,
                                  pp_stages_per_rank=pp_stages_per_rank)
    cfg, model = _planned(model_or_config, seq)
    seq = seq or (cfg.seq_len if cfg is not None else _default_seq(model))
    stage_world, dp, batch, micro = _batch_split(shape, world=world, pp=pp, tp=tp, batch=batch, accum=accum)
    check_composed(ParallelDims.of(world, pp=pp, tp=tp, ep=ep))  # as the runtime refuses a layout it cannot build

    precision = resolve_mp(mp, analytic=False)
    engine, knobs = _stage_engine(shape, kwargs)
    policy = Checkpointing(engine.checkpointing)
    if cfg is not None:
        st = _gpt_stages(cfg, shape.num_stages, micro=micro, seq=seq, precision=precision, policy=policy, tp=tp)
    else:
        st = _traced_stages(model, shape.num_stages, micro=micro, seq=seq, precision=precision, policy=policy,
                            tp=tp)
    order = schedule_order(shape.schedule, pp=pp, stages_per_rank=shape.stages_per_rank,
                           microbatches=shape.microbatches)
    steps = accum * shape.microbatches  # micro-steps of one optimizer step, as the engine sees them
    runs = _stage_runs(shape, order, pp=pp, accum=accum)

    def plan_stage(s: int, carried: ActivationEstimate, micro_steps: int) -> Plan:
        return plan(st.modules[s], world=stage_world, batch=dp * micro * micro_steps, seq=seq,
                    accum=micro_steps, tp=tp, mp=precision, device=device, headroom=headroom,
                    units=st.modules[s].block_modules(), activations=carried, engine=engine,
                    pp=pp, ep=ep, pipeline_order=runs[s], whole=st.whole, **kwargs)

    ranks = [_plan_rank(r, shape, order[r], st, steps=steps, headroom=headroom, plan_stage=plan_stage)
             for r in range(pp)]
    notes = _notes(shape, st.tied, grad_reduce=engine.pp_grad_reduce, steps=steps) + _traced_notes(cfg, tp)
    return PipelinePlan(shape=shape, world=world, dp=dp, micro_batch=micro, gpt=cfg, batch=batch, seq=seq,
                        accum=accum, ranks=tuple(ranks), knobs=knobs, notes=notes, name=st.name,
                        layers=sum(len(b) for b in st.split.blocks), tp=tp, ep=ep)


def _stage_engine(shape: PipelineShape, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The engine options each stage runs, and the knobs taken out of ``kwargs`` (popped: the rest
    are ``zs.plan``'s): the runtime's own options for a stage (pp_grad_reduce as its accumulation),
    with the pipeline's resharding default unless a knob says otherwise."""
    from zeroshard.parallel.pipeline.grad_reduce import stage_options
    from zeroshard.parallel.pipeline.runtime import PIPELINE_RESHARD_AFTER_FORWARD
    from zeroshard.runtime.options import KNOB_NAMES, EngineOptions

    knobs = {k: kwargs.pop(k) for k in list(kwargs) if k in KNOB_NAMES}
    engine = stage_options(EngineOptions.from_flat({"reshard_after_forward": PIPELINE_RESHARD_AFTER_FORWARD,
                                                    **knobs}), stage=kwargs.get("stage"))
    # Each stage's engine checkpoints its own blocks (the runtime's segments of them), so a
    # stage's activations are planned over its blocks alone.
    check_checkpointing(schedule_spec(shape.schedule), engine.checkpointing)  # as the runtime refuses it
    return engine, knobs


def _stage_runs(shape: PipelineShape, order: Any, *, pp: int, accum: int) -> dict[int, tuple]:
    """What each stage's engine runs in a step: its forwards and backwards (or a split backward's
    halves) in torch's order, once per schedule run (accum of them)."""
    return {s: tuple((kind, mb + k * shape.microbatches) for k in range(accum)
                     for kind, mb in stage_order(order[s % pp], s)) for s in range(shape.num_stages)}


def _plan_rank(r: int, shape: PipelineShape, rank_order: Any, st: _Stages, *, steps: int, headroom: float,
               plan_stage: Callable[[int, ActivationEstimate, int], Plan]) -> StageRank:
    """Pp rank ``r``'s plan: the larger of its two moments, each the sum of its stages' plans."""
    stages = shape.stages_of(r)
    moments = peak_in_flight(rank_order, {s: st.weight[s] for s in stages})
    buffers = sum(_buffers(shape, s, one=st.one) for s in stages)
    combined = []
    # Two moments: the activation peak before the rank's first backward has accumulated any
    # grads (one planned micro-step: no carried grad buffers), and the one after it (every
    # micro-step's grads carried in their full buffers, as the engine accumulates them).
    for moment, micro_steps in zip(moments, (1, steps)):
        plans = []
        for k, s in enumerate(stages):
            # The rank's in-flight activations are charged to its first stage.
            carried = _carried(st.est_of[s], st.workspace[s], held=moment.bytes if k == 0 else None,
                               blocks=len(st.split.blocks[s]), last=s == shape.num_stages - 1)
            plans.append(plan_stage(s, carried, micro_steps))
        combined.append(_combine(plans, buffers, headroom))
    worst = max(moments, key=lambda m: m.bytes)
    return StageRank(pp_rank=r, stages=tuple(stages), blocks=tuple(st.split.blocks[s] for s in stages),
                     in_flight=worst.held, activation_bytes=worst.bytes, buffer_bytes=buffers,
                     plan=_larger(*combined))


def _traced_notes(cfg: Any, tp: int) -> tuple[str, ...]:
    """What a plan of a traced (non-GPT) model says about where its activations came from."""
    if cfg is not None:
        return ()
    notes: tuple[str, ...] = ("activations traced from one forward of the whole model on fake tensors, each block's "
                              "charged to its stage, the embeddings' to the first and the head's and loss's to the last",)
    if tp > 1:
        notes += (f"tp={tp}: the traced activations are one tp rank's (what the model's plan leaves split "
                  "counted 1/tp: tp_flow.py)",)
    return notes


def _planned(model_or_config: Any, seq: int | None) -> tuple[Any, Any]:
    """(GPTConfig, None) for a preset name, a GPTConfig or a GPT, at ``seq`` when given; (None,
    model) for any other module (a folder's or a user's model, on the meta device or not)."""
    from torch import nn

    from zeroshard.models import GPT, GPTConfig

    if isinstance(model_or_config, str):
        return GPTConfig.named(model_or_config, **({"seq_len": seq} if seq else {})), None
    if isinstance(model_or_config, GPTConfig):
        return (dataclasses.replace(model_or_config, seq_len=seq) if seq else model_or_config), None
    if isinstance(model_or_config, GPT):
        return model_or_config.cfg, None
    if isinstance(model_or_config, nn.Module):
        return None, model_or_config
    raise ValueError("the pipeline planner plans a model (an nn.Module, on the meta device or not), a GPTConfig or "
                     f"a preset name; got {type(model_or_config).__name__}")


def _default_seq(model: Any) -> int:
    from zeroshard.trainer.adapter import max_positions

    return min(max_positions(model) or 64, 64)


@dataclasses.dataclass(frozen=True)
class _Stages:
    """A model cut as the runtime cuts it, and what one microbatch leaves alive on each stage."""

    name: str
    modules: list
    split: Any
    tied: list
    est_of: dict[int, ActivationEstimate]
    """Each stage's activations over its own blocks."""
    workspace: dict[int, ActivationEstimate]
    """Whose backward temporaries (head, block) each stage plans with."""
    weight: dict[int, int]
    """Bytes one microbatch leaves alive on each stage from its forward to its backward."""
    one: int
    """Bytes of one microbatch's hidden state: a receive buffer."""
    whole: Any
    """The model the stages are cut from: its spec gives their tp split and MoE layers."""


def cut_stages(model: Any, num_stages: int, blocks: str | None = None) -> tuple[list, Any, list]:
    """``model``'s stages as the pipeline runtime cuts them, before it shards each: an even split of its
    blocks (at ``blocks``, its dotted path, or found), the tied head's copy untied on its stage.
    Returns (stage modules, split, tied params)."""
    from zeroshard.parallel.pipeline.layout import layout_of
    from zeroshard.parallel.pipeline.own_forward import StageModule
    from zeroshard.parallel.pipeline.split import even_split
    from zeroshard.parallel.pipeline.tied import find_tied, untie_copy

    layout = layout_of(model, blocks)
    split = even_split(layout.count, num_stages)
    tied = find_tied(model, layout, split)
    modules = []
    for s in range(num_stages):
        module = StageModule(model, layout, split.blocks[s], stage_index=s, num_stages=num_stages)
        for t in tied:
            if s == t.copy_stage:
                untie_copy(module, t)
        modules.append(module)
    return modules, split, tied


def _gpt_stages(cfg, num_stages: int, *, micro: int, seq: int, precision: Any, policy: Checkpointing,
                tp: int) -> _Stages:
    """zeroshard's GPT: each stage's activations from the GPT's formula (activations.py)."""
    from zeroshard.tools.planner.inventory import meta_gpt

    c = torch.empty(0, dtype=precision.compute_dtype(torch.float32)).element_size()
    whole = meta_gpt(cfg)
    modules, split, tied = cut_stages(whole, num_stages)
    est_of = {s: gpt_activations(dataclasses.replace(cfg, n_layer=len(split.blocks[s])), micro_batch=micro, seq=seq,
                                 compute_bytes=c, policy=policy, tp=tp) for s in range(num_stages)}
    weight = {s: _stage_activations(cfg, est_of[s], blocks=len(split.blocks[s]), first=s == 0,
                                    last=s == num_stages - 1, tokens=micro * seq, seq=seq, c=c)
              for s in range(num_stages)}
    # the per-block workspace and the head's, the same on every stage
    return _Stages(name="GPT", modules=modules, split=split, tied=tied, est_of=est_of,
                   workspace={s: est_of[0] for s in range(num_stages)}, weight=weight, one=micro * seq * cfg.n_embd * c,
                   whole=whole)


def _traced_stages(model, num_stages: int, *, micro: int, seq: int, precision: Any,
                   policy: Checkpointing, tp: int = 1) -> _Stages:
    """Any other model: one forward of the whole model traced on fake tensors (traced.py), each
    block's saved bytes charged to its stage, what the embeddings saved to the first stage and
    what the final norm, head and loss saved to the last.

    A stage other than the last also keeps its output for torch's backward call (one hidden
    state); the last keeps the logits (unless autograd saved them already). A stage after the first
    receives its input into torch's buffer, counted with the buffers, so its first block's saved
    input is not counted twice: as ``_stage_activations`` counts zeroshard's GPT. Under ``tp``, what
    one tp rank saves: the model's plan followed through the forward (tp_flow.py)."""
    from zeroshard.parallel.pipeline.layout import layout_of
    from zeroshard.tools.planner.tp import TensorParallel
    from zeroshard.tools.planner.traced import estimate_of, trace

    compute = precision.compute_dtype(next(model.parameters()).dtype)
    c = torch.empty(0, dtype=compute).element_size()
    layout = layout_of(model)
    listed = model.get_submodule(layout.blocks)
    plan = TensorParallel.of_model(model, tp).plan if tp > 1 else None
    t = trace(model, [(f"{layout.blocks}.{i}", b) for i, b in enumerate(listed)], micro_batch=micro, seq=seq,
              compute=compute, tp=tp, tp_plan=plan)
    modules, split, tied = cut_stages(model, num_stages)
    one = max(t.inputs, default=0)
    est_of, weight = {}, {}
    for s in range(num_stages):
        first, last = s == 0, s == num_stages - 1
        root = (t.before if first else 0) + ((t.after + (0 if t.logits_saved else t.logits * c)) if last else 0)
        est_of[s] = estimate_of(t, split.blocks[s], compute, policy, root=root, head_saved=t.after if last else 0)
        weight[s] = _blocks_saved(est_of[s], blocks=len(split.blocks[s])) + root + (0 if last else one) \
            - (0 if first else one)
    return _Stages(name=type(model).__name__, modules=modules, split=split, tied=tied, est_of=est_of,
                   workspace=est_of, weight=weight, one=one, whole=model)


def _carried(stage_est: ActivationEstimate, est: ActivationEstimate, *, held: int | None, blocks: int,
             last: bool) -> ActivationEstimate:
    """What ``zs.plan`` plans a stage with: ``held`` bytes in flight (None: charged to another stage
    of the rank). The microbatch whose backward runs frees its blocks' activations block by block
    (per_layer, or a segment's boundary with checkpointing); the rest stays until later backwards
    (the planner's root). Recompute: the longest segment rebuilt in backward."""
    mine = held is not None
    return ActivationEstimate(
        saved=held or 0, recompute=stage_est.recompute, per_layer=stage_est.per_layer if mine else 0,
        root=(held or 0) - (_blocks_saved(stage_est, blocks=blocks) if mine else 0),
        boundary=stage_est.boundary if mine else 0, segments=stage_est.segments,
        workspace=max(est.head, est.block) if last else est.block, head=est.head if last else 0, block=est.block,
        head_saved=stage_est.head_saved if mine and last else 0)


def _notes(shape: PipelineShape, tied: list, *, grad_reduce: str, steps: int) -> tuple[str, ...]:
    notes = [f"{shape.schedule}: bubble {shape.bubble_rule} = {shape.bubble:.1%} of each rank's step "
             f"(p {shape.pp}, m {shape.microbatches}, v {shape.stages_per_rank})"]
    if tied:
        notes.append(f"tied {tied[0].owner_fqn} = {tied[0].copy_fqn}: the last stage holds its own copy "
                     "(params, grads and optimizer state)")
    if grad_reduce == "microbatch":
        notes.append(f"pp_grad_reduce=microbatch: zero2 and zero3 reduce-scatter after each of the {steps} microbatches "
                     "of a step into the 1/N grad shard; ddp and zero1 keep full grads and reduce once (a run "
                     "refuses microbatch at those stages)")
    return tuple(notes)
