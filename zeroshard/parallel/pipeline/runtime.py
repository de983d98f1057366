"""One rank's part of a pipeline-parallel model: its stages, each a ZeRO engine, run by torch's schedule.

``Pipeline(model, mesh=zs.init(pp=2), stage=S, schedule="1f1b", microbatches=M)`` cuts the model
into ``pp × stages_per_rank`` stages (zeroshard/parallel/pipeline/split.py, layout.py, own_forward.py), keeps this rank's
(stage ``s`` on pp rank ``s % pp``), gives the last stage its own copy of a param tied to the first
(tied.py) and shards each kept stage with ``zs.shard`` over the mesh's stage-local groups: ZeRO
runs over the stage's replicate × shard ranks, exactly as without a pipeline. torch's schedule
drives the stages (stage.py records its sends and receives).

One optimizer step (zeroshard/trainer/step.py ``pipeline_step``): ``run`` once per accumulation step, every
microbatch's backward under ``no_sync``, then ``reduce`` (a tied param's two grads summed over
``pp_ends``, then each engine's reductions, once), ``clip_grad_norm_`` over every stage and shard,
and ``step`` of each stage's optimizer. Under ``no_sync`` stages 2-3 keep every microbatch's grads
unreduced (``pp_grad_reduce="step"``) or reduce-scatter each into the grad shard ("microbatch";
grad_reduce.py). docs/pipeline.md gives the reasons, the memory and the traffic.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.comm import collectives
from zeroshard.comm.mesh import Mesh
from zeroshard.comm.names import Group, Phase
from zeroshard.runtime.materialize import materialize_stages
from zeroshard.parallel.pipeline.aux_loss import stage_aux_loss
from zeroshard.parallel.pipeline.layout import (block_names, hidden_width, layout_of, refuse_router_loss,
                                                vocab_rows)
from zeroshard.parallel.pipeline.own_forward import StageModule
from zeroshard.parallel.pipeline.grad_reduce import stage_options
from zeroshard.parallel.pipeline.schedules import (check_checkpointing, check_compile, check_microbatches, make_schedule,
                                          schedule_spec)
from zeroshard.parallel.pipeline.schedules import stages_per_rank as resolve_stages_per_rank
from zeroshard.parallel.pipeline.split import explicit_split, even_split
from zeroshard.parallel.pipeline.stage import LedgeredStage
from zeroshard.parallel.pipeline.tied import find_tied, sum_tied_grad, sum_tied_reduced_grad, untie_copy
from zeroshard.runtime import get_engine, no_sync, optimizer, shard
from zeroshard.runtime.clip import local_squares, scale_grad_shards, sum_squares_over_shards
from zeroshard.runtime.compiled import CompileArg
from zeroshard.runtime.options import EngineOptions
from zeroshard.runtime.state import full_state_dict

IGNORE_INDEX = -100

PIPELINE_RESHARD_AFTER_FORWARD = True
"""Stage 3 frees a block's full params after each microbatch's forward (docs/pipeline.md: under
1F1B a stage holds up to pp microbatches between their forward and backward, so keeping params
gathered would hold a whole stage's full params for most of the step)."""


class Pipeline:
    """This rank's stages of ``model``, sharded at ``stage`` over ``mesh`` (which must have pp > 1)."""

    def __init__(self, model: nn.Module, *, mesh: Mesh, stage: int, schedule: str = "1f1b", microbatches: int = 0,
                 stages_per_rank: int = 0, split: Sequence[Sequence[str]] | None = None, mp: Any = None,
                 options: EngineOptions | None = None, comm: Any = None, init_fn: Callable | None = None,
                 skip_init: bool = False, compile: CompileArg = None, blocks: str | None = None) -> None:
        if mesh.pp_size < 2:
            raise ValueError("a pipeline needs a mesh with pp >= 2: build it with zs.init(pp=N)")
        options = options or EngineOptions()
        if options.check_schedule:
            raise ValueError("check_schedule does not cover a pipeline's steps yet; turn it off with pp > 1")
        self.mesh = mesh
        self.spec = schedule_spec(schedule)
        check_checkpointing(self.spec, options.checkpointing)
        check_compile(self.spec, compile)
        # pp_grad_reduce as the engine's accumulation (grad_reduce.py)
        opts = stage_options(options, stage=stage)
        per_rank = resolve_stages_per_rank(self.spec, stages_per_rank)
        self.microbatches = microbatches or mesh.pp_size * per_rank  # 0: one per stage, the fewest that fill it
        self.num_stages = mesh.pp_size * per_rank
        self.layout = layout_of(model, blocks)  # blocks: the user's path to a model zeroshard does not know
        refuse_router_loss(model)
        names = block_names(self.layout)
        self.split = explicit_split(split, names, self.num_stages) if split else even_split(len(names),
                                                                                            self.num_stages)
        self.tied = find_tied(model, self.layout, self.split)
        cls = type(model)
        self.model_class = f"{cls.__module__}.{cls.__qualname__}"
        """The whole model's class, which a checkpoint of the stages records (zeroshard/checkpoint/stages.py)."""
        self.state_names = frozenset(model.state_dict(keep_vars=True))
        """Every param and persistent buffer name of the whole model: a checkpoint loaded into this
        rank's stages is checked against them (the stages hold only some)."""
        self.stage_indices = [mesh.pp_rank + k * mesh.pp_size for k in range(per_rank)]
        self.vocab = vocab_rows(model, self.layout)
        self.hidden = hidden_width(model, self.layout)
        # A meta-device model: each stage is sharded with zeroed buffers, then the whole model's init
        # is replayed once, keeping only these stages' shards (zeroshard/runtime/materialize.py).
        meta = any(p.is_meta for p in model.parameters())
        self.modules: list[StageModule] = []
        for s in self.stage_indices:
            module = StageModule(model, self.layout, self.split.blocks[s], stage_index=s, num_stages=self.num_stages)
            module.aux_loss = stage_aux_loss(model, module)  # a per-layer load-balancing loss: each stage its layers'
            for tied in self.tied:
                if s == tied.copy_stage:
                    untie_copy(module, tied)
            shard(module, stage=stage, units=module.block_modules(), mp=mp, options=opts, comm=comm, mesh=mesh,
                  skip_init=meta, compile=compile)
            self.modules.append(module)
        self.tied_copies = {t.copy_fqn: t.owner_fqn for t in self.tied if t.copy_stage in self.stage_indices}
        """This rank's own copies of tied params -> the names they copy (a loader may find either)."""
        if meta and not skip_init:  # skip_init: the values come from a load next (a pretrained folder)
            engines = [get_engine(module) for module in self.modules]
            stats = materialize_stages(model, engines, init_fn, self.tied_copies)
            for engine in engines:
                engine.init_stats = stats
        self.act_dtype = mp.param_dtype if mp is not None and mp.param_dtype is not None else torch.float32
        self._schedule: Any = None
        self._shape: tuple[int, int] | None = None
        self._loss: list[Callable] = []

    # -- the schedule ------------------------------------------------------------------------
    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def check_batch(self, local_batch: int) -> None:
        check_microbatches(self.spec, microbatches=self.microbatches, pp=self.mesh.pp_size, local_batch=local_batch)

    def _build_schedule(self, batch: int, seq: int) -> None:
        """Stages with static shapes (no shape inference: it would run each stage's forward, and
        with it the engine's gathers, outside any step) and the schedule over them."""
        self.check_batch(batch)
        mb = batch // self.microbatches
        stages = []
        for module in self.modules:
            # requires_grad marks the hidden states as differentiable: torch then receives them into
            # buffers that collect their grads, which the stage sends back.
            hidden = torch.empty(mb, seq, self.hidden, dtype=self.act_dtype, device=self.mesh.device,
                                 requires_grad=True)
            tokens = torch.zeros(mb, seq, dtype=torch.long, device=self.mesh.device)
            logits = torch.empty(mb, seq, self.vocab, dtype=self.act_dtype, device=self.mesh.device)
            stages.append(LedgeredStage(module, module.stage_index, self.num_stages, mesh=self.mesh,
                                        input_args=tokens if module.is_first else hidden,
                                        output_args=logits if module.is_last else hidden))
        self._schedule = make_schedule(self.spec, stages, microbatches=self.microbatches,
                                       loss_fn=lambda out, target: self._loss[0](out, target))
        self._shape = (batch, seq)

    def run(self, x: torch.Tensor, y: torch.Tensor, *, loss_scale: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every microbatch of this rank's batch slice, grads left accumulated:
        unreduced, or at stages 2-3 with ``pp_grad_reduce="microbatch"`` reduced into the grad shard.
        Each microbatch backpropagates its token-loss sum × ``loss_scale`` (the data-parallel size over
        the global token count), so the step's grad is the global-batch mean.
        A per-layer load-balancing loss (zeroshard's GPT with MoE) is backpropagated by each stage for
        its own layers (aux_loss.py), with the same scale.
        Returns the summed loss (float64) of this slice: the token loss on the last stage, plus each
        stage's load-balancing share; 0 on a stage with neither."""
        if self._schedule is None:
            self._build_schedule(x.shape[0], x.shape[1])
        elif tuple(x.shape) != self._shape:
            raise ValueError(f"the pipeline's stages were built for batches of {self._shape}, got {tuple(x.shape)}; "
                             "keep the batch and sequence length fixed under pp")
        total = torch.zeros((), dtype=torch.float64, device=x.device)

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            nonlocal total
            # The GPT's own loss (fp32 log-softmax over the vocabulary), summed over tokens.
            loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1),
                                       ignore_index=IGNORE_INDEX, reduction="sum")
            total = total + loss_sum.detach().double()
            return loss_sum * loss_scale.to(loss_sum.dtype)

        self._loss[:] = [loss_fn]
        for module in self.modules:
            if module.aux_loss is not None:
                module.aux_loss.scale = loss_scale
        with contextlib.ExitStack() as stack:
            for module in self.modules:
                stack.enter_context(no_sync(module))
            # return_outputs=False: torch would otherwise keep every microbatch's logits to the step's
            # end and concatenate them (twice the batch's logits), and the loss is all the step needs.
            self._schedule.step(x, target=y, return_outputs=False)
            if self.spec.split_backward:
                for module in self.modules:
                    get_engine(module).split_backward_done()
        for module in self.modules:
            share = module.aux_loss.take() if module.aux_loss is not None else None
            if share is not None:
                total = total + share.to(total.device)
        return total

    # -- after the schedule ------------------------------------------------------------------
    def reduce(self) -> None:
        """Sum each tied param's two grads over ``pp_ends``, then reduce every stage's grads once;
        where a stage reduced after every microbatch (stages 2-3, ``pp_grad_reduce="microbatch"``),
        finish those reductions and sum the tied param's reduced grads instead."""
        for tied in self.tied:
            for s, module in zip(self.stage_indices, self.modules):
                fqn = tied.owner_fqn if s == tied.owner_stage else tied.copy_fqn if s == tied.copy_stage else None
                if fqn is None:
                    continue
                engine = get_engine(module)
                if engine.reduces_inside_no_sync:
                    sum_tied_reduced_grad(engine, fqn, mesh=self.mesh, unit=tied.owner_fqn)
                else:
                    sum_tied_grad(engine.accumulated_grad(fqn), mesh=self.mesh, unit=tied.owner_fqn)
        for module in self.modules:
            engine = get_engine(module)
            if not engine.reduces_inside_no_sync:
                engine.reduce_accumulated()

    def _skip(self, stage_index: int) -> frozenset[str]:
        return frozenset(t.copy_fqn for t in self.tied if t.copy_stage == stage_index)

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the whole model's averaged grad: every stage, every shard, a tied param once."""
        total = torch.zeros(3, dtype=torch.float64, device=self.mesh.device)  # as local_squares
        for s, module in zip(self.stage_indices, self.modules):
            total += local_squares(get_engine(module), self._skip(s))
        # One engine's groups stand for all of this rank's: they share the mesh and the stage.
        sum_squares_over_shards(total, get_engine(self.modules[0]))
        squares = total[:1].clone()
        collectives.all_reduce(squares, group=Group.PP, phase=Phase.CLIP, mesh=self.mesh)
        return squares[0].sqrt().to(torch.float32)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """As zs.clip_grad_norm_, over the norm of every stage; returns the norm before clipping."""
        norm = self.grad_norm()
        scale_grad_shards([g for module in self.modules for g in get_engine(module).trainable_groups], norm, max_norm)
        return norm

    def optimizers(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> list[torch.optim.Optimizer]:
        """One ``zs.optimizer`` per stage of this rank (each over its own engine's shard)."""
        return [optimizer(module, cls, **kwargs) for module in self.modules]

    def pp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the pp group (a loss only the last stage computes), as metrics."""
        out = value.detach().reshape(1).clone()
        collectives.all_reduce(out, group=Group.PP, phase=Phase.METRICS, mesh=self.mesh)
        return out[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every param of the whole model at full size under the unsharded model's names, on every
        rank, on the host (collective: each stage gathers its shards, then the stages exchange theirs
        over pp). They travel pickled, so they are moved to the host first: a pickled CUDA tensor is
        unpickled onto its sender's device on every receiver."""
        mine: dict[str, torch.Tensor] = {}
        for module in self.modules:
            mine.update({name: value.cpu() for name, value in full_state_dict(module).items()})
        parts = collectives.all_gather_object(mine, group=Group.PP, phase=Phase.STATE_DICT, mesh=self.mesh)
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part)
        return out
