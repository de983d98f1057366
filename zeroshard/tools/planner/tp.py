"""Tensor parallelism in the plan: which params a Megatron-style split divides, and what it costs.

The built-in GPT's plan splits each block: ``attn.qkv`` and ``mlp.fc`` column-wise (weight rows
and bias across the tp ranks), ``attn.proj`` and ``mlp.proj`` row-wise (weight columns; the bias
is replicated, added once after the all-reduce). Norms, embeddings and the head stay replicated.
ZeRO then shards each rank's tp-local tensors across the data-parallel ranks, so per-rank params,
grads and optimizer state divide by tp × shard for the split params and by shard alone for the
replicated ones.

Per layer and micro-step, Megatron's accounting (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022, section 4): two all-reduces of the block's
activations (tokens × n_embd) in forward, after each row-wise linear, and two in backward, for the
grads of each column-wise linear's input. With sequence parallelism each all-reduce becomes an
all-gather plus a reduce-scatter of the same buffer: the same bytes on the wire, and the block
input's and residual's activations are split across the tp ranks too; the norms' weight grads
then need a (small) all-reduce each, and the stream is gathered once after the last block.
"""

from __future__ import annotations

import dataclasses

import torch

from zeroshard.tools.planner.comm import Collective
from zeroshard.models.specs.gpt import GPT_MOE_TP_STYLES, GPT_TP_STYLES
from zeroshard.runtime.tp_plan import COLWISE, TPPlan, placement_of

GPT_TP_PLAN = dict(GPT_TP_STYLES)
"""Submodule of each block -> style: the runtime's own split of zeroshard's GPT (Megatron's MLP and attention)."""

ALL_REDUCES_PER_LAYER = 2
"""Per block and direction: one after the attention's row-wise linear, one after the MLP's."""

MOE_ALL_REDUCES_PER_LAYER = 1
"""An MoE block under tp (its MoE layer whole, ``GPT_MOE_TP_STYLES``): the attention's one alone."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """The tp degree of a plan and where it splits. ``tp=1`` splits nothing."""

    tp: int = 1
    sequence_parallel: bool = False
    styles: tuple[tuple[str, str], ...] = tuple(GPT_TP_PLAN.items())

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a positive int (ranks one layer is split over), got {self.tp!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism splits the sequence over the tp ranks; it needs tp > 1")

    plan: TPPlan | None = None
    """A model's own plan (its spec's, zeroshard/models/spec.py), read by name as offline tools read
    it; None for our GPT's ``styles``."""

    def split_dim(self, fqn: str, ndim: int) -> int | None:
        """The dim of param ``fqn`` divided across the tp ranks, or None where it is replicated."""
        if self.tp == 1:
            return None
        if self.plan is not None:
            placement = placement_of(self.plan, fqn, ndim, self.tp)
            return None if placement is None else placement["dim"]
        module, _, leaf = fqn.rpartition(".")
        for name, style in self.styles:
            if module == name or module.endswith("." + name):
                if style == COLWISE:
                    return 0  # output features: the weight's rows and the bias
                return 1 if leaf == "weight" and ndim == 2 else None  # input features; the bias is whole
        return None

    def local_shape(self, fqn: str, shape: torch.Size) -> torch.Size:
        """This rank's part of a param of ``shape`` (what ZeRO flattens and shards)."""
        dim = self.split_dim(fqn, len(shape))
        if dim is None:
            return torch.Size(shape)
        out = list(shape)
        out[dim] //= self.tp
        return torch.Size(out)

    @classmethod
    def of_gpt(cls, cfg, tp: int, sequence_parallel: bool = False) -> TensorParallel:
        """The runtime's split of ``cfg``'s blocks (``gpt_plan``): the attention alone when its MLP
        is routed experts, which stay whole on every tp rank."""
        moe = bool(getattr(cfg, "n_expert", 0))
        return cls(tp=tp, sequence_parallel=sequence_parallel,
                   styles=tuple((GPT_MOE_TP_STYLES if moe else GPT_TP_PLAN).items()))

    @classmethod
    def of_model(cls, model, tp: int, sequence_parallel: bool = False) -> TensorParallel:
        """The runtime's split of any model with a spec (a transformers model's declared plan, or a
        user's), checked as the runtime checks it before anything is split: a ValueError names the
        problem (no plan, tp not dividing the heads or the MLP) and the fix."""
        from zeroshard.models.specs import spec_of
        from zeroshard.runtime.tp import check_plan

        plan = spec_of(model).tp()
        check_plan(model, plan, tp, sequence_parallel=sequence_parallel)
        return cls(tp=tp, sequence_parallel=sequence_parallel, styles=tuple(plan.styles.items()), plan=plan)

    @property
    def splits_mlp(self) -> bool:
        return any(name.startswith("mlp.") for name, _ in self.styles)

    @property
    def all_reduces_per_layer(self) -> int:
        return ALL_REDUCES_PER_LAYER if self.splits_mlp else MOE_ALL_REDUCES_PER_LAYER

    def check_gpt(self, cfg) -> None:
        """The split must be even: heads (attention) and the MLP's hidden size (its two linears;
        an MoE block's MLP is not split)."""
        if not self.splits_mlp:
            if cfg.n_head % self.tp:
                raise ValueError(f"tp={self.tp} does not divide n_head ({cfg.n_head}); pick a tp that divides it")
            return
        for name, size in (("n_head", cfg.n_head), ("the MLP hidden size", cfg.mlp_ratio * cfg.n_embd)):
            if size % self.tp:
                raise ValueError(f"tp={self.tp} does not divide {name} ({size}); pick a tp that divides both "
                                 f"n_head ({cfg.n_head}) and the MLP hidden size ({cfg.mlp_ratio * cfg.n_embd})")


def layer_collectives(tp: TensorParallel, *, layers: int, tokens: int, width: int, compute_bytes: int,
                      micro_steps: int, rebuilt_layers: int = 0, segments: int = 0, norm_vectors: int = 2,
                      gpus_per_node: int | None = None) -> tuple[Collective, ...]:
    """TP collectives of one optimizer step: per layer and micro-step, 2 in forward and 2 in backward
    over a buffer of ``tokens × width`` activations; a checkpointed layer's rebuild runs its forward's
    2 again, except the last of each of the ``segments`` checkpoints the ``rebuilt_layers`` lie in:
    torch's non-reentrant checkpoint stops recomputing once the last tensor backward needs is back
    (early stop), and nothing in a segment saves the all-reduced output of its last row-wise linear
    (measured on the ledger: tests/distributed/test_tp.py, the command line's cases). With sequence
    parallelism (whose rebuild is not measured: counted as its forward's collectives again) each is
    an all-gather plus a reduce-scatter of that buffer, as the runtime (zeroshard.runtime.tp) runs
    it: the last block's output is all-gathered once more
    for the final norm and head (its grad is cut, no comm), the first block's input grad
    all-gathered once in backward (its input is cut, no comm), and each of the ``norm_vectors``
    per layer (the norms' weights and biases, ``width`` each) gets a grad that is a partial sum
    over its ranks' sequence parts: one all-reduce each, per micro-step."""
    if tp.tp == 1:
        return ()
    buffer = tokens * width * compute_bytes
    count = tp.all_reduces_per_layer * (2 * layers + rebuilt_layers) * micro_steps
    spans = gpus_per_node is not None and tp.tp > gpus_per_node
    if not tp.sequence_parallel:
        return (Collective(op="all_reduce", group="tp", size=tp.tp, buffer_bytes=buffer,
                           count=count - segments * micro_steps, spans_nodes=spans),)
    return (Collective(op="all_gather", group="tp", size=tp.tp, buffer_bytes=buffer, count=count + 2 * micro_steps,
                       spans_nodes=spans),
            Collective(op="reduce_scatter", group="tp", size=tp.tp, buffer_bytes=buffer, count=count, spans_nodes=spans),
            Collective(op="all_reduce", group="tp", size=tp.tp, buffer_bytes=width * compute_bytes,
                       count=norm_vectors * layers * micro_steps, spans_nodes=spans))
