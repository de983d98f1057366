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
from typing import TYPE_CHECKING, Callable, overload

import torch
from torch import nn

from zeroshard.comm import collectives
from zeroshard.comm.mesh import Mesh, get_mesh
from zeroshard.comm.names import Group, Phase
from zeroshard.runtime.lazy_dtensor import is_dtensor
from zeroshard.runtime.attached import find_engine
from zeroshard.runtime.tp_plan import (SEQUENCE, SEQUENCE_STYLES, TPPlan, check_divides, check_param_sizes,
                                       chunk_count, matches, resolve, stream_input, stream_parents, torch_style)

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


# -- applying a plan ---------------------------------------------------------------------------
PlanFn = Callable[..., "TPPlan"]


def blocks_of(model: nn.Module, plan: TPPlan) -> list[nn.Module]:
    try:
        blocks = model.get_submodule(plan.blocks)
    except AttributeError:
        raise ValueError(f"the tensor-parallel plan's blocks {plan.blocks!r} are not a module of this "
                         f"{type(model).__name__}; give the spec the dotted path of its blocks' ModuleList") from None
    return list(blocks.children())


def check_plan(model: nn.Module, plan: TPPlan, tp: int, *, sequence_parallel: bool = False) -> None:
    """Whether ``plan`` can split ``model`` over ``tp`` ranks, changing nothing: every style known,
    tp dividing what it splits; a ValueError names the problem and the fix."""
    check_divides(tp, plan.divides, plan.name)
    if sequence_parallel and plan.sequence_refusal:
        raise ValueError(plan.sequence_refusal)
    for index, block in enumerate(blocks_of(model, plan)):
        where = f"{plan.blocks}.{index}."
        resolved = resolve(block, plan.styles, where)
        check_param_sizes(block, resolved, plan.chunks, tp, where)
        if sequence_parallel:
            odd = sorted({s for s in resolved.values() if s not in SEQUENCE_STYLES})
            if odd:
                raise ValueError(f"sequence parallelism does not compose with the style {odd[0]!r} of "
                                 f"{plan.name}'s plan; call zs.tensor_parallel without sequence_parallel")
    outer = resolve(model, plan.outer, "")
    check_param_sizes(model, outer, {}, tp, "")
    if sequence_parallel and outer:
        raise ValueError(f"sequence parallelism does not compose with {plan.name}'s split of {sorted(outer)[0]}; "
                         "call zs.tensor_parallel without sequence_parallel")


def _block_styles(block: nn.Module, plan: TPPlan, sequence_parallel: bool) -> tuple[dict, dict[str, int]]:
    """The block's {submodule: torch ParallelStyle} and {packed submodule: chunks}."""
    from torch.distributed.tensor import Replicate, Shard

    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between the modules
    resolved = resolve(block, plan.styles, "")
    parents = stream_parents(block, resolved) if plan.stream_inputs else []
    styles: dict[str, ParallelStyle] = {}
    for name, style in resolved.items():
        prepared = name.rpartition(".")[0] in parents
        tail = next((n for pattern, n in plan.tails.items() if matches(name, pattern)), 0)
        styles[name] = torch_style(style, stream, prepared=prepared, tail=tail)
    # Each such module takes the stream once as one whole DTensor: its projections' input grads then
    # add up as one Partial DTensor, reduced once per module, not once per projection (q, k, v: three).
    # Under sequence parallelism this is where the all-gather runs.
    styles.update({parent: stream_input(stream) for parent in parents})
    if sequence_parallel:
        styles.update({norm: torch_style(SEQUENCE, stream, prepared=False) for norm in plan.sequence_norms})
    fused = {name: chunk_count(name, style, plan.chunks) for name, style in resolved.items()}
    return styles, {name: n for name, n in fused.items() if n > 1}


def tensor_parallel(model: nn.Module, plan: TPPlan | PlanFn, *, sequence_parallel: bool = False,
                    mesh: Mesh | None = None) -> nn.Module:
    """Split ``model``'s blocks across the mesh's "tp" dim (``zs.init(tp=N)``) by ``plan``, in place;
    then ``zs.shard`` it. ``zs.tensor_parallel`` (zeroshard/parallel/tp.py) reads the plan from the
    model's spec; here it is data (a ``TPPlan``, or ``plan(model, tp)`` returning one).

    Call it on every rank, on a model built the same way on each (same seed), before ``zs.shard``.
    The model may be on the meta device (``zs.meta_init()``): ``zs.shard`` then replays its init at
    full size, one param at a time, and keeps each rank's tp part, bitwise the plain build's.

    ``sequence_parallel``: the residual stream between and inside the blocks is split along the
    sequence (dim 1) across the tp ranks, the norms run on their part of it (torch's
    ``SequenceParallel``), and the first block's input is cut / the last block's output gathered.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    from zeroshard.comm import dtensor_ledger

    _check_unsharded(model)
    mesh = mesh or get_mesh()  # the mesh the model will be sharded over: zs.shard(model, mesh=...) takes the same
    if mesh.tp_size == 1:
        raise ValueError("the mesh has no tp dim; call zs.init(tp=N) (or mesh_shape=..., names=(..., 'tp')) first")
    if not isinstance(plan, TPPlan):
        plan = plan(model, mesh.tp_size)
    check_plan(model, plan, mesh.tp_size, sequence_parallel=sequence_parallel)
    blocks, tp_mesh = blocks_of(model, plan), mesh.tp_mesh
    for block in blocks:
        styles, fused = _block_styles(block, plan, sequence_parallel)
        for name, chunks in fused.items():
            with torch.no_grad():
                for param in block.get_submodule(name).parameters(recurse=False):
                    if not param.is_meta:  # a meta param's values are cut in this layout when zs.shard makes them
                        param.copy_(_interleave(param, chunks, mesh.tp_size))
        parallelize_module(block, tp_mesh, styles)
        for name, chunks in fused.items():
            for param in block.get_submodule(name).parameters(recurse=False):
                setattr(param, CHUNKS_ATTR, chunks)
    outer = resolve(model, plan.outer, "")
    if outer:
        parallelize_module(model, tp_mesh, {name: torch_style(style, Replicate(), prepared=False)
                                            for name, style in outer.items()})
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
    if not group.any_tp:  # asked once per group, not per param every step
        return []
    if not any(spec is not None and spec.shard_dim is not None for spec in group.tp_specs):
        return []
    out = []
    for piece in group.layout.pieces(group.shard_rank):
        spec = group.tp_specs[piece.slot_index]
        if spec is not None and spec.shard_dim is not None:
            out.append((piece.start - group.lo, piece.stop - group.lo))
    return out
