"""MoE plans: where a model's MoE layers are and how one expert computes.

A plan is a function ``plan(model) -> list[MoELayer]``; ``zs.expert_parallel(model, plan=...)``
takes one, and ``PLANS`` holds the ready ones by model class name. An MoE layer for us is the
module that holds the *stacked* expert params (experts on dim 0, transformers 5's layout) and whose
forward is ``forward(hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``: the
model's own router has already chosen the experts, so routing, top-k and capacity stay the
model's. Expert parallelism replaces that forward (zeroshard/parallel/experts/layer.py) and needs from the
plan only how expert ``e`` of the rank's block maps rows to rows (``MoELayer.expert``).

A plan of your own for a layer written differently::

    def my_plan(model):
        return [MoELayer(name=n, module=m, num_experts=m.n, params=("w1", "w2"),
                         expert=lambda m, e, x: torch.relu(x @ m.w1[e]) @ m.w2[e])
                for n, m in model.named_modules() if isinstance(m, MyExperts)]

Indices of ``top_k_index`` outside ``[0, num_experts)`` are dropped tokens (the layer's capacity
rule already applied, as transformers marks them with ``num_experts``); a dropless model has none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

ExpertFn = Callable[[Any, int, torch.Tensor], torch.Tensor]


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
    expert: ExpertFn
    """``expert(module, e, rows) -> rows``: expert ``e`` of this rank's block (local index, after
    the split) applied to the rows routed to it, before the routing weight."""
    router: nn.Module | None = None
    """The layer's router, when it computes a load-balancing loss from per-expert counts: it has a
    ``reduce_counts`` attribute, which ``experts.apply.share_routing_counts`` sets to an all-reduce
    of the counts over the data-parallel ranks, so the loss is the global batch's (zeroshard's GPT: ``MoEMLP``)."""


def hf_stacked_expert(module: Any, e: int, rows: torch.Tensor) -> torch.Tensor:
    """transformers 5's gated expert (Mixtral, Qwen2-MoE, Qwen3-MoE): down(act(gate(x)) * up(x))."""
    gate, up = nn.functional.linear(rows, module.gate_up_proj[e]).chunk(2, dim=-1)
    return nn.functional.linear(module.act_fn(gate) * up, module.down_proj[e])


def hf_moe_plan(model: nn.Module) -> list[MoELayer]:
    """Every transformers 5 experts module with the concatenated, untransposed gate_up/down layout
    and no biases (MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts)."""
    layers = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Experts") and _hf_layout(module):
            layers.append(MoELayer(name=name, module=module, num_experts=int(module.num_experts),
                                   params=("gate_up_proj", "down_proj"), expert=hf_stacked_expert))
    return layers


def _hf_layout(module: nn.Module) -> bool:
    own = dict(module.named_parameters(recurse=False))
    return set(own) == {"gate_up_proj", "down_proj"} and own["gate_up_proj"].dim() == 3 and \
        hasattr(module, "act_fn") and hasattr(module, "num_experts") and \
        own["gate_up_proj"].shape[1] == 2 * own["down_proj"].shape[2]


def gpt_moe_plan(model: nn.Module) -> list[MoELayer]:
    """zeroshard's GPT with ``n_expert > 0``: each block's ``mlp.experts`` (zeroshard/models/gpt.py)."""
    from zeroshard.models.gpt import MoEMLP, gpt_expert

    return [MoELayer(name=f"{name}.experts", module=mlp.experts, num_experts=mlp.experts.num_experts,
                     params=mlp.experts.param_names, expert=gpt_expert, router=mlp)
            for name, mlp in model.named_modules() if isinstance(mlp, MoEMLP)]


PLANS: dict[str, Callable[[nn.Module], list[MoELayer]]] = {
    "GPT": gpt_moe_plan,
    "MixtralForCausalLM": hf_moe_plan,
    "Qwen2MoeForCausalLM": hf_moe_plan,
    "Qwen3MoeForCausalLM": hf_moe_plan,
}
"""Ready plans by model class name."""


def plan_for(model: nn.Module) -> Callable[[nn.Module], list[MoELayer]] | None:
    return PLANS.get(type(model).__name__)
