"""Tensor parallelism through torch's own API, and what ZeRO needs to know about its params.

``tensor_parallel(model)`` applies ``torch.distributed.tensor.parallel.parallelize_module`` with
Megatron-style ColwiseParallel / RowwiseParallel to every block on the mesh's "tp" dim: the
attention's input projections and the MLP's first linear are split by output rows, the output
projections by input columns, so each block costs one all-reduce in forward (after each row-wise
linear) and one in backward (the grad of each column-wise group's input). Embeddings, norms and
the head stay replicated. No TP code of our own runs: the layers' weights become DTensors.
With ``sequence_parallel`` the stream between them is split along the sequence instead (torch's
``SequenceParallel`` on the norms): each all-reduce becomes a reduce-scatter plus an all-gather.

``zs.shard`` then flattens each DTensor param's *local* tensor and shards it across the "shard"
dim, the same composition as FSDP2's 2-D mode; when its params are rebuilt, the local views are
wrapped back into DTensors with the same placements (``TPSpec.wrap``). See docs/tensor_parallel.md.
A meta model may be parallelised too: ``zs.shard`` then replays each param at full size and keeps
this rank's part of it (``to_local``), bitwise the plain build's (docs/init.md).

A fused projection (the built-in GPT's ``qkv``: q, k and v stacked by rows) must give each rank
its own heads of all three. ``chunks=3`` records that the param is three row blocks each sharded
across tp: the rows are reordered before distribution so that rank r's contiguous Shard(0) slice
is [q_r; k_r; v_r], and ``canonical``/``to_local`` convert between that and the model's own layout.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, overload

import torch
from torch import nn

from zeroshard.comm import collectives
from zeroshard.comm.mesh import Mesh, get_mesh
from zeroshard.comm.names import Group, Phase
from zeroshard.runtime.lazy_dtensor import is_dtensor
from zeroshard.runtime.attached import find_engine

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement
    from torch.distributed.tensor.parallel import ParallelStyle

# DTensor and the parallel styles are imported where a model is split, not with this module
# (zeroshard/runtime/lazy_dtensor.py says why).

CHUNKS_ATTR = "_zeroshard_tp_chunks"
"""On a TP param: how many equal row blocks of it are sharded separately (fused qkv: 3)."""


@dataclasses.dataclass(frozen=True)
class TPSpec:
    """How one param is laid out across the tp dim."""

    mesh: DeviceMesh  # the 1-D tp DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size  # global
    stride: tuple[int, ...]  # global
    chunks: int = 1

    @property
    def shard_dim(self) -> int | None:
        """The dim split across tp ranks, or None for a replicated param."""
        from torch.distributed.tensor import Shard

        placement = self.placements[0]
        return placement.dim if isinstance(placement, Shard) else None

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's part, e.g. a view of a flat buffer) as a DTensor with this spec."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                      stride=self.stride)

    def describe(self) -> dict:
        """The placement as the checkpoint manifest records it."""
        return {"placement": "shard" if self.shard_dim is not None else "replicate", "dim": self.shard_dim,
                "chunks": self.chunks, "tp": self.mesh.size()}


def spec_of(param: torch.Tensor) -> TPSpec | None:
    if not is_dtensor(param):
        return None
    return TPSpec(mesh=param.device_mesh, placements=tuple(param.placements), shape=param.shape,
                  stride=param.stride(), chunks=getattr(param, CHUNKS_ATTR, 1))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a param or its grad); a plain tensor as it is."""
    if is_dtensor(tensor):
        return tensor.to_local()
    return tensor


@overload
def local_grad(grad: torch.Tensor, spec: TPSpec | None) -> torch.Tensor: ...
@overload
def local_grad(grad: None, spec: TPSpec | None) -> None: ...
def local_grad(grad: torch.Tensor | None, spec: TPSpec | None) -> torch.Tensor | None:
    """This rank's part of a param's grad, in the param's own placement (a grad DTensor may arrive
    in another, e.g. Partial: it is redistributed first, which DTensor does with a tp collective)."""
    if is_dtensor(grad):
        if spec is not None and tuple(grad.placements) != spec.placements:
            grad = grad.redistribute(placements=spec.placements)
        return grad.to_local()
    return grad


def local_shape(param: torch.Tensor) -> torch.Size:
    return param.to_local().shape if is_dtensor(param) else param.shape


# -- canonical (model) layout <-> tp-local -----------------------------------------------------
def to_local(full: torch.Tensor, describe: dict, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of a full tensor in the model's own layout (a manifest entry's placement)."""
    dim, tp, chunks = describe.get("dim"), describe.get("tp", 1), describe.get("chunks", 1)
    if dim is None or tp == 1:
        return full
    blocks = full.chunk(chunks, dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[tp_rank] for b in blocks], dim=dim)


def canonical(locals_in_tp_order: list[torch.Tensor], describe: dict) -> torch.Tensor:
    """The full tensor in the model's own layout from every tp rank's part."""
    dim, chunks = describe.get("dim"), describe.get("chunks", 1)
    if dim is None or len(locals_in_tp_order) == 1:
        return locals_in_tp_order[0]
    per_rank = [t.chunk(chunks, dim=dim) for t in locals_in_tp_order]
    return torch.cat([torch.cat([parts[c] for parts in per_rank], dim=dim) for c in range(chunks)], dim=dim)


def _interleave(tensor: torch.Tensor, chunks: int, tp: int) -> torch.Tensor:
    """Rows reordered so that the contiguous tp-slice r is [block_0 slice r; block_1 slice r; ...]."""
    return torch.cat([to_local(tensor, {"dim": 0, "tp": tp, "chunks": chunks}, r) for r in range(tp)], dim=0)


# -- plans -------------------------------------------------------------------------------------
def _check_divides(tp: int, sizes: dict[str, int], what: str) -> None:
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"tp={tp} does not divide {name}={size} of this {what}; pick a tp that divides "
                             f"{name} (each tp rank holds {name}/tp of it)")


COLWISE, ROWWISE = "colwise", "rowwise"
"""Megatron's two splits: a linear's output features (weight rows and bias) across the tp ranks, or
its input features (weight columns; the bias added once after the all-reduce)."""

GPT_TP_STYLES: dict[str, str] = {"attn.qkv": COLWISE, "attn.proj": ROWWISE, "mlp.fc": COLWISE, "mlp.proj": ROWWISE}
"""Submodule of each GPT block -> its split; the planner (zeroshard/tools/planner/tp.py) reads the same table."""


GPT_MOE_TP_STYLES: dict[str, str] = {name: style for name, style in GPT_TP_STYLES.items() if name.startswith("attn.")}
"""A GPT block whose MLP is routed experts (``n_expert > 0``): the attention alone is split. The
MoE layer stays whole on every tp rank (its router computes on every token); with ep its experts
are split over ep instead, each tp rank dispatching its share of the tokens (zeroshard/parallel/experts/)."""

GPT_FUSED = {"attn.qkv": 3}
"""The GPT's fused projections: q, k and v stacked by rows in one linear, each split on its own."""

LLAMA_TP_STYLES: dict[str, str] = {
    "self_attn.q_proj": COLWISE, "self_attn.k_proj": COLWISE, "self_attn.v_proj": COLWISE,
    "self_attn.o_proj": ROWWISE, "mlp.gate_proj": COLWISE, "mlp.up_proj": COLWISE, "mlp.down_proj": ROWWISE}
"""Submodule of each Llama decoder layer -> its split (transformers' own plan)."""

HF_MOE_TP_STYLES: dict[str, str] = {name: style for name, style in LLAMA_TP_STYLES.items()
                                    if name.startswith("self_attn.")}
"""An HF MoE decoder layer (Mixtral, Qwen2-MoE): its attention is Llama's, split the same way; its
sparse MoE block (router, stacked experts, Qwen2-MoE's shared expert) stays whole, its experts split
by ep instead (zeroshard/parallel/experts/)."""

NAMED_PLANS: dict[str, tuple[str, dict[str, str], dict[str, int]]] = {
    "gpt": ("blocks", GPT_TP_STYLES, GPT_FUSED), "llama": ("model.layers", LLAMA_TP_STYLES, {})}
"""The ready plans by name, as offline tools see them: (blocks' prefix, styles, fused chunks).
``ckpt reshard --tp-plan`` reads the placements of a checkpoint saved without TP from here."""


def placement_by_name(plan: str, fqn: str, ndim: int, tp: int) -> dict | None:
    """Param ``fqn``'s placement (as ``TPSpec.describe``) under ready plan ``plan`` at degree ``tp``,
    or None where that plan keeps it whole: column-wise splits the weight's rows and the bias,
    row-wise the weight's columns (the bias is replicated)."""
    if plan not in NAMED_PLANS:
        raise ValueError(f"unknown tensor-parallel plan {plan!r}; use one of {', '.join(NAMED_PLANS)}")
    prefix, styles, fused = NAMED_PLANS[plan]
    head, _, rest = fqn.partition(prefix + ".")
    index, _, inside = rest.partition(".")
    if head or not index.isdigit():
        return None
    module, _, leaf = inside.rpartition(".")
    style = styles.get(module)
    if style is None or tp == 1:
        return None
    dim = 0 if style == COLWISE else (1 if leaf == "weight" and ndim == 2 else None)
    if dim is None:
        return None
    return {"placement": "shard", "dim": dim, "chunks": fused.get(module, 1), "tp": tp}


def gpt_plan(model: nn.Module, tp: int, sequence_parallel: bool = False
             ) -> tuple[list[nn.Module], dict, dict[str, int]]:
    """The built-in GPT: qkv and mlp.fc column-wise, attn.proj and mlp.proj row-wise; with
    ``sequence_parallel`` the norms run on Shard(1) (the sequence dim) and the splits take and give it."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    cfg: Any = model.cfg
    moe = bool(getattr(cfg, "n_expert", 0))
    if moe:
        _check_divides(tp, {"n_head": cfg.n_head}, "GPT")
        if sequence_parallel:
            raise ValueError("sequence parallelism with an MoE GPT (n_expert > 0) is not supported: its MoE layer "
                             "needs the whole sequence on every tp rank; call zs.tensor_parallel without "
                             "sequence_parallel")
    else:
        _check_divides(tp, {"n_head": cfg.n_head, "mlp hidden size": cfg.mlp_ratio * cfg.n_embd}, "GPT")
    styles = GPT_MOE_TP_STYLES if moe else GPT_TP_STYLES
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() if style == COLWISE else RowwiseParallel()
                                      for name, style in styles.items()}
    if sequence_parallel:
        # The residual stream stays split by sequence: each column-wise linear all-gathers its
        # input, each row-wise linear reduce-scatters its output (Megatron-SP).
        plan = {name: ColwiseParallel(input_layouts=Shard(1)) if style == COLWISE
                else RowwiseParallel(output_layouts=Shard(1)) for name, style in styles.items()}
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
    blocks: Any = model.blocks
    return list(blocks), plan, dict(GPT_FUSED)


def llama_plan(model: nn.Module, tp: int, sequence_parallel: bool = False
               ) -> tuple[list[nn.Module], dict, dict[str, int]]:
    """HF Llama: q/k/v and gate/up column-wise, o_proj and down_proj row-wise (as transformers' own
    plan); with ``sequence_parallel`` the two RMSNorms run on Shard(1), as torchtitan's plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    cfg: Any = model.config
    _check_divides(tp, {"num_attention_heads": cfg.num_attention_heads,
                        "num_key_value_heads": cfg.num_key_value_heads,
                        "intermediate_size": cfg.intermediate_size}, "Llama")
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between the modules
    col, row = ColwiseParallel(), RowwiseParallel(output_layouts=stream)
    plan: dict[str, ParallelStyle] = {name: col if style == COLWISE else row
                                      for name, style in LLAMA_TP_STYLES.items()}
    # The attention's (and the MLP's) input becomes one replicated DTensor before its column-wise
    # projections: their input grads then add up as one Partial DTensor and are reduced once per
    # module, not once per projection (q, k, v: three). Under SP this is where the all-gather runs.
    plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": stream},
                                           desired_input_kwarg_layouts={"hidden_states": Replicate()})
    plan["mlp"] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
    if sequence_parallel:
        plan.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()})
    decoder: Any = model.model
    return list(decoder.layers), plan, {}


def hf_moe_attention_plan(model: nn.Module, tp: int, sequence_parallel: bool = False
                          ) -> tuple[list[nn.Module], dict, dict[str, int]]:
    """HF Mixtral and Qwen2-MoE: the attention as Llama's (q/k/v column-wise, o_proj row-wise to a
    replicated output); the sparse MoE block stays whole (experts split by ep, zeroshard/parallel/experts/).
    Not Qwen3-MoE: its per-head q/k norms hold one weight that every tp rank's heads would use, whose
    grad would then be a partial sum on each tp rank."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    cfg: Any = model.config
    if sequence_parallel:
        raise ValueError(f"sequence parallelism with HF {type(model).__name__} is not supported: its MoE block "
                         "needs the whole sequence on every tp rank; call zs.tensor_parallel without sequence_parallel")
    _check_divides(tp, {"num_attention_heads": cfg.num_attention_heads,
                        "num_key_value_heads": cfg.num_key_value_heads}, type(model).__name__)
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() if style == COLWISE else RowwiseParallel()
                                      for name, style in HF_MOE_TP_STYLES.items()}
    plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                           desired_input_kwarg_layouts={"hidden_states": Replicate()})
    decoder: Any = model.model
    return list(decoder.layers), plan, {}


PlanFn = Callable[..., tuple[list[nn.Module], dict, dict[str, int]]]
PLANS: dict[str, PlanFn] = {"GPT": gpt_plan, "LlamaForCausalLM": llama_plan,
                            "MixtralForCausalLM": hf_moe_attention_plan, "Qwen2MoeForCausalLM": hf_moe_attention_plan}


def tensor_parallel(model: nn.Module, plan: PlanFn | None = None, *, sequence_parallel: bool = False,
                    mesh: Mesh | None = None) -> nn.Module:
    """Split ``model``'s blocks across the mesh's "tp" dim (``zs.init(tp=N)``), in place; then ``zs.shard`` it.

    ``plan(model, tp)`` returns (blocks, {submodule name: ParallelStyle}, {name: chunks}); the
    built-in GPT and HF ``LlamaForCausalLM`` have one. Call it on every rank, on a model built the
    same way on each (same seed), before ``zs.shard``. The model may be on the meta device
    (``zs.meta_init()``): ``zs.shard`` then replays its init at full size, one param at a time, and
    keeps each rank's tp part, bitwise the plain build's.

    ``sequence_parallel``: the residual stream between and inside the blocks is split along the
    sequence (dim 1) across the tp ranks, the norms run on their part of it (torch's
    ``SequenceParallel``), and the first block's input is cut / the last block's output gathered.
    A custom plan is then called as ``plan(model, tp, sequence_parallel=True)``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    from zeroshard.comm import dtensor_ledger

    _check_unsharded(model)
    mesh = mesh or get_mesh()  # the mesh the model will be sharded over: zs.shard(model, mesh=...) takes the same
    if mesh.tp_size == 1:
        raise ValueError("the mesh has no tp dim; call zs.init(tp=N) (or mesh_shape=..., names=(..., 'tp')) first")
    if plan is None:
        name = type(model).__name__
        if name not in PLANS:
            raise ValueError(f"no tensor-parallel plan for {name}; pass plan=fn(model, tp) -> (blocks, "
                             f"{{submodule: ColwiseParallel()/RowwiseParallel()}}, {{submodule: chunks}})")
        plan = PLANS[name]
    blocks, styles, fused = plan(model, mesh.tp_size, sequence_parallel=True) if sequence_parallel else \
        plan(model, mesh.tp_size)
    tp_mesh = mesh.tp_mesh
    for block in blocks:
        for name, chunks in fused.items():
            linear = block.get_submodule(name)
            with torch.no_grad():
                for param in linear.parameters(recurse=False):
                    if not param.is_meta:  # a meta param's values are cut in this layout when zs.shard makes them
                        param.copy_(_interleave(param, chunks, mesh.tp_size))
        parallelize_module(block, tp_mesh, styles)
        for name, chunks in fused.items():
            for param in block.get_submodule(name).parameters(recurse=False):
                setattr(param, CHUNKS_ATTR, chunks)
    if sequence_parallel and blocks:
        # Before torch's input hook: an uneven cut would reach gloo as mismatched sizes and abort
        # the process (NCCL would hang) instead of a Python error.
        blocks[0].register_forward_pre_hook(_sequence_divides(mesh.tp_size), with_kwargs=True, prepend=True)
        # Between the blocks the stream stays split: cut the first block's (replicated) input, which
        # needs no communication, and all-gather the last block's output for the final norm and head.
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
        parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))
    dtensor_ledger.start()
    return model


def _sequence_divides(tp: int) -> Callable:
    """A forward pre-hook for the first block under sequence parallelism: its input's sequence
    (dim 1) must split evenly across the ``tp`` ranks."""

    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        stream = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if isinstance(stream, torch.Tensor) and stream.dim() >= 2 and stream.shape[1] % tp:
            raise ValueError(f"sequence parallelism splits the sequence across tp={tp} ranks, but this batch's "
                             f"length is {stream.shape[1]}; pad or crop sequences to a multiple of {tp}, or call "
                             "zs.tensor_parallel without sequence_parallel")

    return check


def _check_unsharded(model: nn.Module) -> None:
    """TP must change the params' layout before ``zs.shard`` flattens them.

    A model built for real or on meta is fine (on meta, ``zs.shard`` replays the init at each
    param's full shape and keeps this rank's tp part: docs/init.md). A model ``zs.shard`` already
    built, e.g. by constructor replay, has its flat buffers laid out unsplit and is refused.
    """
    if find_engine(model) is not None:
        raise ValueError("tensor_parallel must run before zs.shard, but this model is already sharded (zs.shard with "
                         "a constructor builds and shards in one call); build the model for real or under "
                         "zs.meta_init(), call zs.tensor_parallel(model), then zs.shard(model)")


def full_value(value: torch.Tensor, spec: TPSpec | None, *, unit: str = "", phase: str = Phase.STATE_DICT,
               mesh: Mesh | None = None) -> torch.Tensor:
    """A param's full tensor in the model's own layout from this rank's tp part (a collective over
    "tp" for a tp-sharded param; the value itself otherwise)."""
    if spec is None or spec.shard_dim is None:
        return value
    dim, size = spec.shard_dim, collectives.group_size(Group.TP, mesh)
    moved = value.movedim(dim, 0).contiguous()
    out = torch.empty((size, *moved.shape), dtype=value.dtype, device=value.device)
    collectives.all_gather(out.view(-1), moved.view(-1), group=Group.TP, unit=unit, phase=phase, mesh=mesh)
    return canonical([part.movedim(0, dim) for part in out.unbind(0)], spec.describe())


def tp_sharded_ranges(group) -> list[tuple[int, int]]:
    """[start, stop) ranges of ``group.grad_shard`` (a FlatGroup's shard) that hold tp-sharded params."""
    if not any(spec is not None and spec.shard_dim is not None for spec in group.tp_specs):
        return []
    out = []
    for piece in group.layout.pieces(group.shard_rank):
        spec = group.tp_specs[piece.slot_index]
        if spec is not None and spec.shard_dim is not None:
            out.append((piece.start - group.lo, piece.stop - group.lo))
    return out
