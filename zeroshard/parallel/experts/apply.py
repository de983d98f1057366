"""``zs.expert_parallel``: split a model's experts over the ep ranks before ``zs.shard`` shards it.

The composition order is torchtitan's: build the model (same seed on every rank), split the
experts (this module), then ``zs.shard`` shards the dense params over the dense mesh and each
rank's experts over the expert mesh (``Mesh.experts``), as flat groups of their own inside the
same units. One engine then drives both kinds of params through one step: hooks, reductions,
``no_sync``, the optimizer, clipping and ``full_state_dict`` need nothing else.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from zeroshard.comm import collectives
from zeroshard.comm.mesh import Mesh, get_mesh
from zeroshard.comm.names import Phase
from zeroshard.parallel.experts.layer import ExpertParallelForward
from zeroshard.runtime.expert_placement import expert_mesh_of, mark_expert
from zeroshard.parallel.experts.plan import MoELayer, MoELayoutError, declared_ep_plan, moe_layout

Plan = Callable[[nn.Module], list[MoELayer]]


class ExpertParallelError(ValueError):
    """A model or an ep that expert parallelism cannot split; the message names the fix."""


def moe_layers(model: nn.Module, plan: Plan | None = None) -> list[MoELayer]:
    """The model's MoE layers by ``plan`` (default: the layout its declared ep plan gives; none: [])."""
    try:
        return (plan or moe_layout)(model)
    except MoELayoutError as e:
        raise ExpertParallelError(str(e)) from None


def check_ep(model: nn.Module, ep: int, plan: Plan | None = None) -> list[MoELayer]:
    """The model's MoE layers, or a one-line error when ``ep`` cannot split them."""
    layers = moe_layers(model, plan)
    if not layers:
        what = ("declares an ep plan, but no module of it matches one" if plan is None and declared_ep_plan(model)
                else "declares no expert-parallel plan (transformers' config.base_model_ep_plan, or an ep_plan)")
        raise ExpertParallelError(f"ep={ep} needs a mixture-of-experts model, but {type(model).__name__} {what}; "
                                  "use ep=1, a model with experts (tiny-moe, an HF MoE folder whose config declares "
                                  "base_model_ep_plan), or pass zs.expert_parallel(model, plan=...) for your own layer")
    for layer in layers:
        if layer.num_experts % ep:
            raise ExpertParallelError(f"ep={ep} does not divide the {layer.num_experts} experts of {layer.name}; "
                                      f"pick an ep that divides {layer.num_experts}")
    return layers


def expert_parallel(model: nn.Module, *, mesh: Mesh | None = None, plan: Plan | None = None,
                    values_from_folder: bool = False) -> nn.Module:
    """Keep only this rank's block of experts in every MoE layer and route tokens to the others.

    ``mesh`` is the dense mesh ``zs.shard`` will get (the default one unless given); its
    ``experts`` (from ``zs.init(ep=N)``) says how the experts are split. ``plan`` finds the MoE
    layers (zeroshard/parallel/experts/plan.py); by default the layout of the ep plan the model declares. Call it on
    every rank, on a model built with the same seed, before ``zs.shard``. Returns the model.
    A model on the meta device keeps meta blocks, filled after ``zs.shard``: by the replay of the
    model's init, which draws the stacked experts as a plain build does and keeps this rank's rows
    (zeroshard/runtime/materialize.py), or by a pretrained folder's read (each rank its block;
    ``values_from_folder=True`` says so, and changes nothing here).
    """
    from zeroshard.runtime.attached import find_engine

    mesh = mesh or get_mesh()
    experts = mesh.experts
    if experts is None:
        raise ExpertParallelError("this mesh has no ep dim: build it with zs.init(ep=N) (or new_mesh(ep=N)) with N > 1")
    if find_engine(model) is not None:
        raise ExpertParallelError("expert_parallel must run before zs.shard, but this model is already sharded; "
                                  "build a fresh model, call zs.expert_parallel(model), then zs.shard(model)")
    layers = check_ep(model, experts.ep_size, plan)
    for layer in layers:
        _split(layer, experts, mesh)
    share_routing_counts(layers, mesh)
    share_router_aux_counts(model, mesh)
    return model


def share_routing_counts(layers: list[MoELayer], mesh: Mesh) -> None:
    """Make each router's load-balancing loss the global batch's: its per-expert counts are summed
    over every data-parallel rank first. Needed under data parallelism with or without ep (each
    rank's own counts would give each rank a different loss)."""
    for layer in layers:
        if layer.router is not None:
            setattr(layer.router, "reduce_counts", functools.partial(_all_reduce_counts, unit=layer.name, mesh=mesh))


def share_router_aux_counts(model: nn.Module, mesh: Mesh) -> None:
    """The same for a Hugging Face MoE model whose config asks for its routers' load-balancing loss
    (zeroshard/models/router_aux.py): its assignment and row counts are summed over the batch's ranks."""
    from zeroshard.models.router_aux import set_count_reduction

    set_count_reduction(model, functools.partial(_all_reduce_counts, unit="router_aux", mesh=mesh))


def _all_reduce_counts(counts: torch.Tensor, *, unit: str, mesh: Mesh) -> None:
    """A router's per-expert counts summed over every rank that holds part of the batch."""
    collectives.all_reduce(counts, group=mesh.dp_name, unit=unit, phase=Phase.FORWARD, mesh=mesh)


def _split(layer: MoELayer, experts: Any, dense: Mesh) -> None:
    local = layer.num_experts // experts.ep_size
    first = experts.ep_rank * local
    for name in layer.params:
        param = getattr(layer.module, name)
        if expert_mesh_of(param) is not None:
            raise ExpertParallelError(f"{layer.name}.{name} is split already; call zs.expert_parallel once per model")
        if param.shape[0] != layer.num_experts:
            raise ExpertParallelError(f"{layer.name}.{name} has {param.shape[0]} rows on dim 0, not one per expert "
                                      f"({layer.num_experts}); a plan's params must stack the experts on dim 0")
        with torch.no_grad():
            mine = nn.Parameter(param.detach()[first:first + local].clone(), requires_grad=param.requires_grad)
        mark_expert(mine, experts)
        setattr(layer.module, name, mine)
    # An instance attribute wins over the class's forward (transformers' experts-implementation
    # dispatch included) and keeps every param's name, so checkpoints and exports see the model's
    # own names.
    layer.module.forward = ExpertParallelForward(layer, experts, dense)


def ep_forwards(model: nn.Module) -> dict[str, ExpertParallelForward]:
    """Each expert-parallel layer's forward by layer name: what a test reads its routing from."""
    return {name: module.forward for name, module in model.named_modules()
            if isinstance(getattr(module, "forward", None), ExpertParallelForward)}
