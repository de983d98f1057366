"""A tensor-parallel plan as data, and the torch ``ParallelStyle`` each of its style names stands for.

A plan names, for each block (the children of one ``nn.ModuleList``), which submodules are split
and how, by transformers' style vocabulary (``config.base_model_tp_plan``): the runtime never
knows a model class. zeroshard/models/spec.py derives a plan from a model's spec; a user may write
one. Each name maps onto torch's own styles, so every split is DTensor's:

============================== ===========================================================================
``colwise``                    ``ColwiseParallel``: weight rows and bias split, output stays split (local)
``rowwise``                    ``RowwiseParallel``: weight columns split, output all-reduced (or reduce-
                               scattered along the sequence under sequence parallelism)
``colwise_gather_output``      ``ColwiseParallel(output_layouts=Replicate())``: the output all-gathered
``rowwise_split_input``        ``RowwiseParallel(input_layouts=Replicate())``: a whole input cut locally
``packed_colwise``             ``colwise`` on a fused projection (gate and up, or q, k and v stacked by
                               rows): each row block is split on its own (``chunks``, default 2), so a
                               rank's slice holds its part of every block (zeroshard/runtime/tp.py)
``replicated_with_grad_allreduce`` a whole param that sees only this rank's heads (Qwen3's per-head q/k
                               norms): torch's ``SequenceParallel`` on the heads dim (-2), so DTensor
                               sums its grad over the tp ranks and forward needs no collective
``embedding_rowwise``          ``RowwiseParallel`` on an ``nn.Embedding``: the vocabulary split, the
                               ranks' lookups summed
``sequence_parallel``          ``SequenceParallel``: a norm on the sequence-split stream
``mla_kv_a_proj``              a whole projection (MLA's ``kv_a_proj_with_mqa``) whose output's last
                               ``tails`` features (the rotary key part) every rank's heads read: their
                               grad, a partial sum over the heads, is summed over the tp ranks (as
                               transformers' ``MlaKvAProjParallel``); the rest reaches a column-split
                               projection, whose input grad is summed already
============================== ===========================================================================

Any other name (``moe_tp_experts``, ``packed_rowwise``, ...) is refused by name
when it names a module the model has: nothing is approximated.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement
    from torch.distributed.tensor.parallel import ParallelStyle

COLWISE, ROWWISE = "colwise", "rowwise"
COLWISE_GATHER, ROWWISE_SPLIT = "colwise_gather_output", "rowwise_split_input"
PACKED_COLWISE, REPLICATED_GRAD = "packed_colwise", "replicated_with_grad_allreduce"
EMBEDDING_ROWWISE, SEQUENCE = "embedding_rowwise", "sequence_parallel"
SHARED_TAIL = "mla_kv_a_proj"
STYLES = (COLWISE, ROWWISE, COLWISE_GATHER, ROWWISE_SPLIT, PACKED_COLWISE, REPLICATED_GRAD, EMBEDDING_ROWWISE,
          SEQUENCE, SHARED_TAIL)
"""The style names a plan may use."""
COLUMN_STYLES = (COLWISE, COLWISE_GATHER, PACKED_COLWISE)
"""Styles that split a linear's output features: its input is whole on every rank, its input grad a partial sum."""
SEQUENCE_STYLES = (COLWISE, ROWWISE, PACKED_COLWISE, REPLICATED_GRAD, SEQUENCE)
"""Styles that compose with sequence parallelism (the stream between them split along the sequence)."""


@dataclasses.dataclass(frozen=True)
class TPPlan:
    """Where a model is split across the tp ranks: per block, and (``outer``) around the blocks."""

    blocks: str
    """Dotted path of the ``nn.ModuleList`` whose children are the blocks."""
    styles: Mapping[str, str]
    """Submodule pattern inside each block (``*`` matches one name) -> style name."""
    outer: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Module pattern from the model's root, outside the blocks (a vocabulary-split embedding) -> style."""
    chunks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """A ``packed_colwise`` entry -> how many row blocks it stacks (default 2: gate and up)."""
    divides: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Sizes tp must divide (heads, kv heads, MLP width), checked before anything is split."""
    tails: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """An ``mla_kv_a_proj`` entry -> how many of its output's last features every rank's heads read."""
    sequence_norms: tuple[str, ...] = ()
    """The block's children that run on the sequence-split stream under sequence parallelism."""
    sequence_refusal: str = ""
    """Why sequence parallelism is refused for this model (empty: allowed)."""
    stream_inputs: bool = True
    """Give each module whose split projections read one input (an attention, an MLP) that input once
    as a whole DTensor: the projections' input grads then add up before one all-reduce, not one each."""
    name: str = "model"
    """What the errors call the model."""


def check_divides(tp: int, sizes: Mapping[str, int], what: str) -> None:
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"tp={tp} does not divide {name}={size} of this {what}; pick a tp that divides "
                             f"{name} (each tp rank holds {name}/tp of it)")


def matches(name: str, pattern: str) -> bool:
    """``name`` (a dotted module path) is matched by ``pattern``, name by name (``*`` one name), as
    torch's ``parallelize_module`` and transformers' plans match."""
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want))


def resolve(root: nn.Module, entries: Mapping[str, str], where: str) -> dict[str, str]:
    """Each module of ``root`` an entry's pattern matches -> its style; a style outside STYLES, or an
    entry that names a param rather than a module, refused by name."""
    modules = dict(root.named_modules())
    params = dict(root.named_parameters(remove_duplicate=False))
    out: dict[str, str] = {}
    for pattern, style in entries.items():
        hits = [n for n in modules if n and matches(n, pattern)]
        if not hits and any(matches(n, pattern) for n in params):
            raise ValueError(f"tensor-parallel style {style!r} on param {where}{pattern} splits a bare param, which "
                             "zeroshard does not; use tp=1 for this model, or a plan without that entry")
        if hits and style not in STYLES:
            raise ValueError(f"tensor-parallel style {style!r} (on {where}{pattern}) is not supported; use tp=1 for "
                             f"this model, or a plan of the styles {', '.join(STYLES)}")
        out.update({n: style for n in hits})
    return out


def check_param_sizes(root: nn.Module, resolved: Mapping[str, str], chunks: Mapping[str, int], tp: int,
                      where: str) -> None:
    """Every split dim divides evenly over tp (each row block of a packed projection on its own)."""
    for name, style in resolved.items():
        weight = getattr(root.get_submodule(name), "weight", None)
        if not isinstance(weight, nn.Parameter) or style in (REPLICATED_GRAD, SEQUENCE, SHARED_TAIL):
            continue
        if style in COLUMN_STYLES or style == EMBEDDING_ROWWISE:
            n = chunk_count(name, style, chunks)
            size, what = weight.shape[0] // n, "output features" if style != EMBEDDING_ROWWISE else "embedding rows"
        else:
            size, what, n = weight.shape[-1], "input features", 1
        if size % tp or weight.shape[0] % n:
            blocks = f" in each of its {n} packed blocks" if n > 1 else ""
            raise ValueError(f"tp={tp} does not divide the {size} {what}{blocks} of {where}{name} ({style}); pick a "
                             "tp that divides it")


def chunk_count(name: str, style: str, chunks: Mapping[str, int]) -> int:
    """How many row blocks a column-split module stacks: as ``chunks`` says, else 2 for
    ``packed_colwise`` (transformers' gate and up) and 1 otherwise. An output gathered whole is in
    the model's own order already: never reordered."""
    if style not in (COLWISE, PACKED_COLWISE):
        return 1
    given = next((c for pattern, c in chunks.items() if matches(name, pattern)), None)
    return given if given is not None else (2 if style == PACKED_COLWISE else 1)


def torch_style(style: str, stream: Placement, *, prepared: bool, tail: int = 0) -> ParallelStyle:
    """The torch style for ``style``; ``stream``: the residual stream's layout (Shard(1) under sequence
    parallelism, else Replicate); ``prepared``: the module's input arrives as a whole DTensor already;
    ``tail``: an ``mla_kv_a_proj``'s shared last features."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if style in (COLWISE, PACKED_COLWISE):
        return ColwiseParallel() if prepared else ColwiseParallel(input_layouts=stream)
    if style == COLWISE_GATHER:
        return ColwiseParallel(output_layouts=Replicate())
    if style == ROWWISE:
        return RowwiseParallel(output_layouts=stream)
    if style == ROWWISE_SPLIT:
        return RowwiseParallel(input_layouts=Replicate())
    if style == EMBEDDING_ROWWISE:
        return RowwiseParallel(input_layouts=Replicate())
    if style == REPLICATED_GRAD:
        # The param is replicated, its input is this rank's heads (dim -2): DTensor computes the
        # norm locally and turns the param's grad, a partial sum over the heads, into the total.
        return SequenceParallel(sequence_dim=-2, use_local_output=True)
    if style == SHARED_TAIL:
        return shared_tail(tail)
    assert style == SEQUENCE, style
    return SequenceParallel()


def shared_tail(tail: int) -> ParallelStyle:
    """A whole module whose output's last ``tail`` features feed every rank's heads: in backward
    their grad (this rank's heads' part) is summed over the tp ranks by DTensor (a Partial grad
    made Replicate); forward is unchanged."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.parallel import ParallelStyle

    class SharedTail(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def hook(_: nn.Module, args: tuple, output: Any) -> Any:
                kept, shared = output.split([output.shape[-1] - tail, tail], dim=-1)
                shared = DTensor.from_local(shared, device_mesh, (Replicate(),), run_check=False)
                return torch.cat([kept, shared.to_local(grad_placements=(Partial(),))], dim=-1)

            module.register_forward_hook(hook)
            return module

    if tail < 1:
        raise ValueError(f"tensor-parallel style {SHARED_TAIL!r} needs the size of its output's shared part "
                         "(the config's qk_rope_head_dim); give it in the spec's tp_tails")
    return SharedTail()


def stream_input(stream: Placement) -> ParallelStyle:
    """A module's first tensor input (positional, or ``hidden_states=``) as one whole DTensor."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput

    class StreamInput(PrepareModuleInput):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                def whole(x: Any) -> Any:
                    if not hasattr(x, "dim"):
                        return x
                    if not isinstance(x, DTensor):  # a norm under sequence parallelism gives a DTensor already
                        x = DTensor.from_local(x, device_mesh, (stream,), run_check=False)
                    return x.redistribute(placements=(Replicate(),))
                if args:
                    return (whole(args[0]), *args[1:]), kwargs
                if "hidden_states" in kwargs:
                    return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}
                return args, kwargs

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return StreamInput()


def stream_parents(block: nn.Module, resolved: Mapping[str, str]) -> list[str]:
    """The modules whose column-split projections all read the module's input: each holds only
    planned params (so no unplanned linear of it sees a DTensor), e.g. an attention or an MLP."""
    out = []
    for parent in sorted({n.rpartition(".")[0] for n, s in resolved.items() if s in COLUMN_STYLES}):
        if not parent:
            continue
        module = block.get_submodule(parent)
        planned = {n for n in resolved if n.startswith(parent + ".")}
        owners = {f"{parent}.{n}".rpartition(".")[0] for n, _ in module.named_parameters()}
        if all(any(o == p or o.startswith(p + ".") for p in planned) for o in owners):
            out.append(parent)
    return out


def placement_of(plan: TPPlan, fqn: str, ndim: int, tp: int) -> dict | None:
    """Param ``fqn``'s placement (as ``TPSpec.describe``) under ``plan`` at degree ``tp``, read from the
    names alone (offline tools: ``ckpt reshard --tp-plan``), or None where the plan keeps it whole."""
    if tp == 1:
        return None
    module, _, leaf = fqn.rpartition(".")
    head, _, rest = module.partition(plan.blocks + ".")
    index, _, inside = rest.partition(".")
    if not head and index.isdigit():
        style = next((s for p, s in plan.styles.items() if matches(inside, p)), None)
        name = inside
    else:
        style = next((s for p, s in plan.outer.items() if matches(module, p)), None)
        name = module
    if style in COLUMN_STYLES or style == EMBEDDING_ROWWISE:
        dim: int | None = 0
    elif style in (ROWWISE, ROWWISE_SPLIT):
        dim = 1 if leaf == "weight" and ndim == 2 else None
    else:
        dim = None
    if dim is None or style is None:
        return None
    return {"placement": "shard", "dim": dim, "chunks": chunk_count(name, style, plan.chunks), "tp": tp}
