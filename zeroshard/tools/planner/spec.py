"""What the planner is asked: the inputs of one plan, validated once, plus the small parsers
(``80GB``, ``7e9``) the CLI and the library share; checkpointing policies and offload kinds are the
runtime's own.

Every problem raises ``ValueError`` naming the field and the fix, so a bad flag never reaches the
arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import torch

from zeroshard.comm.dims import ParallelDims
from zeroshard.runtime.flat import StagePolicy
from zeroshard.runtime.options import EngineOptions
from zeroshard.runtime.precision import MixedPrecision, parse_dtype
from zeroshard.runtime.recompute import segment_bounds, segment_length

STAGE_NAMES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}

PLANNED_KNOBS = ("checkpointing", "offload", "bucket_mb", "prefetch", "reshard_after_forward",
                 "max_inflight_reductions", "accumulation", "pp_grad_reduce")
"""The engine's knobs (zeroshard.runtime.options.KNOBS) a memory plan depends on, and so the ones
`zeroshard plan` takes (pp_grad_reduce with --pp only). The others change when things happen, not what is resident at the peak
(backward_prefetch_at, reap_when_done), or nothing a plan counts (check_schedule, the disk files'
directory and slice size)."""
ACCOUNTINGS = ("runtime", "textbook")
_SIZE_UNITS = {"": 1e9, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """``80GB`` (decimal), ``80GiB`` (binary), ``8e10`` or a bare number of GB, to bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"a memory size must be positive, got {text!r}")
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write it like 80GB, 80GiB or 512MB")
    value = float(match.group(1))
    # A bare large number is bytes (8e10); a bare small one is GB (80), which is what people type.
    scale = 1 if unit == "" and value >= 1e6 else _SIZE_UNITS[unit]
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value * scale)


def parse_count(text: str | int | float) -> int:
    """A parameter count: ``7e9``, ``7B``, ``350M``, ``1.3b``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", str(text))
        if match is None:
            raise ValueError(f"cannot read parameter count {text!r}; write it like 7e9, 7B or 350M")
        value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    if value < 1 or not math.isfinite(value):
        raise ValueError(f"parameter count must be at least 1, got {text!r}")
    return int(round(value))


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing of the blocks, as the runtime does it (zeroshard/runtime/recompute.py).

    The policy string is the runtime's and so is its meaning: ``segments`` are the runtime's own
    (``segment_bounds``), each a run of consecutive blocks that keeps only its input and is rebuilt
    whole in backward. ``every:K`` is segments of K blocks, ``all`` = ``every:1``, ``sqrt`` about
    √L segments of about √L blocks.
    """

    policy: str = "none"

    @classmethod
    def parse(cls, text: str | Checkpointing | None) -> Checkpointing:
        if isinstance(text, Checkpointing):
            return text
        value = "none" if text is None else str(text)
        segment_length(value, 1)  # the runtime's parser: what it refuses, the plan refuses
        return cls(value)

    def segments(self, blocks: int) -> list[tuple[int, int]]:
        """``[start, stop)`` block ranges recomputed together; empty without checkpointing."""
        return segment_bounds(self.policy, blocks)

    def __str__(self) -> str:
        return self.policy


def resolve_optimizer(optimizer: Any) -> type:
    """A ``torch.optim.Optimizer`` subclass from a class, a name (``adamw``) or ``module:Class``."""
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer
    if not isinstance(optimizer, str):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer subclass or its name, got {optimizer!r}")
    if ":" in optimizer:
        import importlib

        module_name, _, attr = optimizer.partition(":")
        found = getattr(importlib.import_module(module_name), attr, None)
    else:
        names = {n.lower(): n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)}
        found = getattr(torch.optim, names[optimizer.lower()]) if optimizer.lower() in names else None
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise ValueError(f"optimizer {optimizer!r} is not a torch.optim optimizer; use a name like adamw, adam or "
                         "sgd, or module:Class for your own")
    return found


def resolve_mp(mp: MixedPrecision | str | None, *, analytic: bool) -> MixedPrecision:
    """``fp32``/``bf16``/``fp16`` mean what ``zeroshard train --mp`` means: compute dtype, fp32 reduction.

    In analytic mode the default is the ZeRO paper's mixed-precision recipe (16-bit params and grads, fp32 master)
    so that the textbook table comes out; a model keeps the runtime's default (its own dtypes).
    """
    if isinstance(mp, MixedPrecision):
        return mp
    if mp is None:
        if analytic:
            return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        return MixedPrecision()
    dtype = parse_dtype(mp)
    return MixedPrecision(param_dtype=None if dtype == torch.float32 and not analytic else dtype,
                          reduce_dtype=torch.float32)


def trainer_clip() -> float:
    """``zeroshard train``'s grad clipping when none is given: the trainer's own default, read."""
    from zeroshard.trainer.sections import OptimSection

    return OptimSection().clip


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """The run being planned. ``batch`` is the GLOBAL batch per optimizer step, as in ``zeroshard train``.

    ``dims`` is the layout (zeroshard/comm/dims.py): ``world`` (one pipeline stage's ranks) and
    every degree are read from it. ``tp`` consecutive ranks split each layer (tensor parallelism) and
    the ``world / tp`` data-parallel ranks (``dp``) shard and replicate as the stage says."""

    dims: ParallelDims
    """The layout: pp, the replicas and shard groups of hybrid sharding, tp and ep."""
    stage: int | None = None
    """The stage you intend to run (highlighted, and measured by ``--measure``); every stage is planned."""
    mp: MixedPrecision
    optimizer: type
    optimizer_kwargs: dict = dataclasses.field(default_factory=dict)
    batch: int
    seq: int
    accum: int = 1
    clip: float = dataclasses.field(default_factory=trainer_clip)
    """The run's global grad-norm clipping (``zeroshard train``'s ``clip``; 0 does not clip). Only a
    run that clips squares its grads in float64 chunks each step (the non-finite guard alone reads fp32
    buffer norms): the chunk is in the step's peak only then."""
    engine: EngineOptions = dataclasses.field(default_factory=EngineOptions)
    """The engine's knobs the run will use (checkpointing, offload, prefetch, resharding, buckets,
    accumulation): the runtime's own options object, so the plan reads what the engine reads."""
    headroom: float = 0.10
    """Allocator headroom as a fraction of the allocated peak (fragmentation, cached blocks)."""
    accounting: str = "runtime"
    comm_quant: str = "none"
    """Quantized communication as ``--comm-quant`` spells it (zeroshard/tools/planner/quant.py plans it)."""
    comm_quant_block: int = 256
    sequence_parallel: bool = False
    """With tp > 1: also split the norms' and residual's activations along the sequence."""
    routing_skew: float = 0.0
    """With ep > 1: extra rows the busiest ep rank receives, as a share of the balanced
    ``tokens × top_k`` (0 balanced, 1 twice its share); sizes its all-to-all buffers and traffic."""
    cp_attention: str = "ring"
    """With cp > 1: the attention scheme whose exchanges and buffers are planned (ring or ulysses)."""
    pipeline_order: tuple[tuple[str, int], ...] | None = None
    """One pipeline stage's forwards and backwards in torch's order (``step_schedule``'s
    ``pipeline_order``): the step its engine runs, which its collectives and gather window follow."""

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ParallelDims):
            raise ValueError(f"dims must be a ParallelDims, got {self.dims!r}")
        _positive_int("batch", self.batch)
        _positive_int("seq", self.seq)
        _positive_int("accum", self.accum)
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or self.clip < 0:
            raise ValueError(f"clip={self.clip!r} must be a number >= 0 (0 does not clip)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel splits the sequence over the tp ranks; it needs tp > 1")
        self._check_ep()
        if self.cp > 1:
            from zeroshard.parallel.cp.layout import CP_SCHEMES, check_seq

            if self.cp_attention not in CP_SCHEMES:
                raise ValueError(f"cp_attention={self.cp_attention!r} is not a scheme; use one of {', '.join(CP_SCHEMES)}")
            check_seq(self.seq, cp=self.cp, scheme=self.cp_attention)
        if self.stage is not None:
            StagePolicy(self.stage)  # the runtime's own check
        if self.batch % (self.dp * self.accum):
            where = f"world {self.world}" if self.tp == 1 else f"{self.dp} data-parallel ranks"
            raise ValueError(f"global batch {self.batch} does not split over {where} × accum {self.accum}; "
                             f"use a multiple of {self.dp * self.accum}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom is a fraction of the peak in [0, 1), got {self.headroom!r}; 0.1 means 10%")
        if self.accounting not in ACCOUNTINGS:
            raise ValueError(f"accounting must be 'runtime' or 'textbook', got {self.accounting!r}")
        self._check_comm_quant()

    def _check_ep(self) -> None:
        if isinstance(self.routing_skew, bool) or not isinstance(self.routing_skew, (int, float)) or \
                not 0 <= self.routing_skew < float("inf"):
            raise ValueError(f"routing_skew is the busiest ep rank's extra share of routed rows, a number >= 0 "
                             f"(0 balanced, 1 twice its share), got {self.routing_skew!r}")
        if self.routing_skew and self.ep == 1:
            raise ValueError("routing_skew sizes the expert-parallel all-to-alls; it needs ep > 1")

    @property
    def world(self) -> int:
        """Ranks of one pipeline stage (every rank without pp)."""
        return self.dims.stage_world

    @property
    def tp(self) -> int:
        """Tensor-parallel degree: ranks one layer is split over (Megatron's column/row split)."""
        return self.dims.tp

    @property
    def ep(self) -> int:
        """Expert parallelism: each MoE layer's experts split over ``ep`` consecutive data-parallel ranks,
        each expert sharded over the ``world / ep`` ranks that hold it (zeroshard/tools/planner/experts.py)."""
        return self.dims.ep

    @property
    def cp(self) -> int:
        """Context parallelism: ranks each sequence is split over (a rank's activations are seq / cp tokens')."""
        return self.dims.cp

    @property
    def zero_dp(self) -> int:
        """Ranks ZeRO shards over without hybrid groups: data-parallel × cp."""
        return self.dims.grad_dp

    @property
    def pp(self) -> int:
        """Pipeline stages: ``world`` is then one stage's ranks (zeroshard/tools/planner/pipeline.py plans each)."""
        return self.dims.pp

    @property
    def shard_size(self) -> int | None:
        """Hybrid sharding's shard groups; None when every data-parallel rank is one group."""
        return self.dims.shard if self.dims.hybrid else None

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: those holding the same experts, which shard them (the
        experts are not tensor parallel, so ep's ranks come from dp x tp)."""
        return self.dims.edp

    def _check_comm_quant(self) -> None:
        from zeroshard.comm.quant import CommQuant
        from zeroshard.runtime.flat import StagePolicy

        comm = CommQuant.parse(self.comm_quant, self.comm_quant_block)  # bad spec or block: a clear error
        if self.stage is not None:
            comm.check_stage(StagePolicy(self.stage))

    @property
    def checkpointing(self) -> Checkpointing:
        """The engine's checkpointing policy, with the segments it recomputes."""
        return Checkpointing(self.engine.checkpointing)

    @property
    def offload(self) -> str:
        """Where the engine keeps masters and optimizer state: none, cpu or disk."""
        return self.engine.offload.kind

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those that see different batches, and shard and reduce together."""
        return self.dims.dp

    @property
    def micro_batch(self) -> int:
        """Sequences per rank per micro-step: what activations scale with (a tp group shares them)."""
        return self.batch // (self.dp * self.accum)

    @property
    def tokens(self) -> int:
        """Tokens a rank runs per micro-step (a cp rank holds seq / cp of each sequence)."""
        return self.micro_batch * self.seq // self.cp

    @property
    def hybrid(self) -> bool:
        return self.dims.hybrid

    def describe(self) -> dict[str, Any]:
        def name(d: torch.dtype | None) -> str | None:
            return None if d is None else str(d).removeprefix("torch.")

        return {
            "world": self.world, "stage": self.stage, "batch": self.batch, "micro_batch": self.micro_batch,
            "seq": self.seq, "accum": self.accum, "clip": self.clip, **self.engine.flat(), "shard_size": self.shard_size,
            "headroom": self.headroom, "accounting": self.accounting, "optimizer": self.optimizer.__name__,
            "param_dtype": name(self.mp.param_dtype), "reduce_dtype": name(self.mp.reduce_dtype),
            "comm_quant": self.comm_quant, "comm_quant_block": self.comm_quant_block,
            "tp": self.tp, "dp": self.dp, "sequence_parallel": self.sequence_parallel,
            "ep": self.ep, "edp": self.edp, "routing_skew": self.routing_skew,
            **({"cp": self.cp, "cp_attention": self.cp_attention} if self.cp > 1 else {}),
        }


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
