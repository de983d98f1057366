"""MoE layouts: where a model's MoE layers are, read from the expert-parallel plan it declares.

An MoE layer for us is the module that holds the *stacked* expert params (experts on dim 0,
transformers 5's layout) and whose forward is ``forward(hidden (T, H), top_k_index (T, k),
top_k_weights (T, k)) -> (T, H)``: the model's own router has already chosen the experts, so
routing (softmax or sigmoid, grouped top-k, correction biases), shared experts and capacity stay
the model's. Expert parallelism replaces only that forward (zeroshard/parallel/experts/layer.py),
and runs the module's *own* forward on the rows each rank receives, through ``LocalExperts``: the
module seen with only this rank's block of experts, called top-1 with unit weights on local ids
(transformers' own ``AllToAllEP`` runs its experts the same way). So expert biases, clamped or
interleaved gates, transposed weights and whichever experts implementation the config selects
(eager, grouped_mm, batched_mm) are the model's code, not a copy of it.

``moe_layout(model)`` is the one derivation, from the plan the model declares: a transformers 5
model's ``ep_plan`` (its config's ``base_model_ep_plan`` under the base model's prefix), or an
``ep_plan`` dict on a model of any other kind in the same format (zeroshard's GPT declares one):

    {"layers.*.mlp.experts": "ep_dispatch_experts",          # the module whose forward is replaced
     "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",    # stacked params, split on dim 0
     "layers.*.mlp.experts.gate_up_proj_bias": "grouped_gemm", ...}

``*`` stands for a layer number, as in transformers' plans. A style this module does not run is
refused by name. A plan of your own for a layer written differently is a function
``plan(model) -> list[MoELayer]``; give ``expert`` when the module's forward cannot run on a subset
of its experts::

    def my_plan(model):
        return [MoELayer(name=n, module=m, num_experts=m.n, params=("w1", "w2"),
                         expert=lambda m, e, x: torch.relu(x @ m.w1[e]) @ m.w2[e])
                for n, m in model.named_modules() if isinstance(m, MyExperts)]

Indices of ``top_k_index`` outside ``[0, num_experts)`` are dropped tokens (the layer's capacity
rule already applied, as transformers marks them with ``num_experts``); a dropless model has none.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch
from torch import nn

from zeroshard.runtime.expert_placement import expert_mesh_of

ExpertFn = Callable[[Any, int, torch.Tensor], torch.Tensor]

EXPERTS_STYLE = "ep_dispatch_experts"
"""The plan's style for the module holding the experts (its forward is replaced)."""
STACKED_STYLE = "grouped_gemm"
"""The plan's style for a param stacking the experts on dim 0 (split over the ep ranks)."""


class MoELayoutError(ValueError):
    """A declared ep plan that expert parallelism cannot honour; the message names the piece."""


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One MoE layer as expert parallelism sees it."""

    name: str
    """The module's name in the model (the ledger's unit for its all-to-alls)."""
    module: nn.Module
    """Holds the stacked expert params and has the (hidden, top_k_index, top_k_weights) forward."""
    num_experts: int
    params: tuple[str, ...]
    """Its stacked expert params (dim 0 = expert), split across the ep ranks."""
    expert: ExpertFn | None = None
    """``expert(module, e, rows) -> rows``, for a module whose forward cannot run on a subset of
    its experts: expert ``e`` of this rank's block (local index) on the rows routed to it, before
    the routing weight. None (derived layouts): the module's own forward runs (``LocalExperts``)."""
    router: nn.Module | None = None
    """The layer's router, when it computes a load-balancing loss from per-expert counts: it has a
    ``reduce_counts`` attribute, which ``experts.apply.share_routing_counts`` sets to an all-reduce
    of the counts over the data-parallel ranks, so the loss is the global batch's (zeroshard's GPT: ``MoEMLP``)."""


def declared_ep_plan(model: nn.Module) -> dict[str, str]:
    """The expert-parallel plan ``model`` declares, keys relative to ``model`` (``*`` = a layer number):
    its spec's (zeroshard/models/spec.py: a transformers config's ``base_model_ep_plan`` under the base
    model's prefix, zeroshard's GPT's own, or a user's), else an ``ep_plan`` dict the model carries."""
    from zeroshard.models.specs import find_spec

    spec = find_spec(model)
    if spec is not None and spec.ep_plan:
        return dict(spec.ep_plan)
    return dict(getattr(model, "ep_plan", None) or {})


def _generic(name: str) -> str:
    """A module or param name with its layer numbers as ``*`` (transformers' plan-key form)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def moe_layout(model: nn.Module) -> list[MoELayer]:
    """Every MoE layer of ``model`` by the plan it declares (``declared_ep_plan``); [] for none."""
    plan = declared_ep_plan(model)
    if not plan:
        return []
    unknown = sorted({style for style in plan.values() if style not in (EXPERTS_STYLE, STACKED_STYLE)})
    if unknown:
        raise MoELayoutError(f"{type(model).__name__}'s ep plan uses the style(s) {', '.join(unknown)}, which "
                             f"zeroshard does not run (it runs {EXPERTS_STYLE} and {STACKED_STYLE}); use ep=1")
    from zeroshard.runtime.attached import find_engine

    # A sharded model's params are flat pieces; the shapes that count experts are its layout's.
    engine = find_engine(model)
    shapes = {s.fqn: s.shape for g in engine.groups for s in g.layout.slots} if engine is not None else {}
    layers = []
    for name, module in model.named_modules():
        if plan.get(_generic(name)) != EXPERTS_STYLE:
            continue
        params = tuple(p for p, _ in module.named_parameters(recurse=False)
                       if plan.get(_generic(f"{name}.{p}")) == STACKED_STYLE)
        if not params:
            raise MoELayoutError(f"{name} is the experts module of {type(model).__name__}'s ep plan, but none of its "
                                 f"params is marked {STACKED_STYLE}; use ep=1")
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        router = parent if hasattr(parent, "reduce_counts") else None
        layers.append(MoELayer(name=name, module=module, num_experts=_total_experts(module, params, name, shapes),
                               params=params, router=router))
    return layers


def _total_experts(module: nn.Module, params: tuple[str, ...], name: str, shapes: dict) -> int:
    """The layer's expert count: dim 0 of its stacked params (their layout's shapes once sharded),
    times ep once they are split."""
    rows = set()
    for p in params:
        param = getattr(module, p)
        mesh = expert_mesh_of(param)
        rows.add(shapes.get(f"{name}.{p}", param.shape)[0] * (mesh.ep_size if mesh is not None else 1))
    if len(rows) != 1:
        raise MoELayoutError(f"the stacked params {', '.join(params)} of {name} disagree on the expert count (dim 0: "
                             f"{sorted(rows)}); an ep plan's params must stack the same experts on dim 0")
    return rows.pop()


class LocalExperts:
    """An experts module seen with only this rank's ``local`` experts, for its own forward to run on.

    The module's stacked params already hold only this rank's block (``zs.expert_parallel``); what
    still says "all experts" is the count the forward sizes its one-hot or histogram from, an int
    attribute equal to the whole count (``num_experts`` in transformers' experts and zeroshard's
    GPT). The view answers the local count for it and reads everything else from the module at call
    time (the params the sharding engine installs included); the module itself is not changed, so
    checkpoints, exports and a later ``moe_layout`` see it as it was.
    """

    def __init__(self, module: nn.Module, total: int, local: int) -> None:
        object.__setattr__(self, "_module", module)
        counts = {k: local for k, v in vars(module).items()
                  if type(v) is int and v == total and "expert" in k and not k.startswith("_")}
        object.__setattr__(self, "_counts", counts)
        object.__setattr__(self, "_forward", type(module).forward)  # the class's, not the replaced instance one

    def __getattr__(self, name: str) -> Any:
        counts = object.__getattribute__(self, "_counts")
        if name in counts:
            return counts[name]
        return getattr(object.__getattribute__(self, "_module"), name)

    def __call__(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each row through its local expert (``local_ids``: (R,)), before the routing weight: the
        module's forward top-1 with unit weights, whose product with 1 is exact."""
        index = local_ids.reshape(-1, 1)
        ones = torch.ones(index.shape, dtype=rows.dtype, device=rows.device)
        if rows.shape[0] == 0:
            # No rows came: one zero row keeps the experts in the graph, so each rank's reduction
            # holds the same params every step (their grad is zero), then none is returned.
            zero = rows.sum(dim=0, keepdim=True)
            return self._forward(self, zero, index.new_zeros((1, 1)), ones.new_ones((1, 1)))[:0]
        return self._forward(self, rows, index, ones)
