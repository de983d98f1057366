"""The load-balancing loss of a Hugging Face MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
GPT-OSS, ...), made exact over data-parallel ranks and expert parallelism.

transformers adds it when the config asks (``output_router_logits=True``, weight
``router_aux_loss_coef``) and the model's code computes one (its modeling module's
``load_balancing_loss_func``; DeepSeek-V3, whose routing is balanced by a correction bias instead,
has none), per forward call, over every MoE layer's router logits of that call:
``aux = E · Σ_e (C_e / N) · (S_e / N)``, ``C_e`` the top-k assignments to expert ``e``, ``S_e`` the
sum of its softmax probabilities, ``N`` the rows (tokens ×
MoE layers; with an attention mask, the unmasked ones). It is a product of two means over the
call's tokens, so each rank's own would be a different loss from the one of the batch the ranks
hold together.

Here one forward of zeroshard's step is one *global* micro-batch (micro-batch m of every rank):
its loss is transformers' ``mean CE + coef · aux`` of that global micro-batch, what one process
computes when its forward sees all of it. ``C``, ``N`` and ``K`` (the scored targets) are summed
over every rank that holds part of the batch (one all-reduce of E + 2 float64 per forward, through
the comm gateway on the engine's data-parallel group, installed by ``zs.expert_parallel`` /
``zeroshard.trainer.step.build`` as ``REDUCE_ATTR``); ``S`` stays the rank's own. Each rank's term,
``E · Σ_e (C_e/N)(S_e/N) · K``, is in sum form: the ranks' terms add up to ``aux · K``, which the
step divides once by the targets it scores, like the token losses. With accumulation the step's
loss is then the scored-token-weighted mean of its global micro-batches' transformers losses; a
loss over the whole step would need every micro-batch's routing before the first backward (an
extra forward). The gradient flows through ``S`` only, as in transformers (the counts are a top-k).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn

REDUCE_ATTR = "_zeroshard_reduce_router_counts"
"""The model attribute holding the in-place sum of the counts over the data-parallel ranks."""


def router_aux_coef(model: nn.Module) -> float:
    """The weight of the model's load-balancing loss, 0 when its config does not ask for it."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    if not getattr(config, "num_experts_per_tok", None) or not _num_experts(config):
        return 0.0
    if model_balance_loss(model) is None:  # the model's own forward adds no such loss
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def model_balance_loss(model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The model's own ``load_balancing_loss_func`` (from its modeling module), or None: what this
    module computes in sum form, and what tests/unit/test_moe_layout.py holds it to."""
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    return fn if callable(fn) else None


def _num_experts(config: Any) -> int:
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def set_count_reduction(model: nn.Module, reduce: Callable[[torch.Tensor], None]) -> None:
    """Sum the loss's counts with ``reduce`` (an in-place sum over the batch's ranks) before use."""
    if router_aux_coef(model):
        object.__setattr__(model, REDUCE_ATTR, reduce)


def aux_loss_sum(model: nn.Module, router_logits: tuple[torch.Tensor, ...], scored: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's term of the load-balancing loss in sum form (see the module docstring).

    ``router_logits``: one ``(tokens, E)`` tensor per MoE layer of the forward, as transformers
    records them; ``scored``: the targets this rank's token loss counts; ``attention_mask``:
    ``(batch, seq)``, 0 for padding, as transformers' ``load_balancing_loss_func`` takes it.
    """
    config: Any = getattr(model, "config")  # a transformers PretrainedConfig
    experts, top_k = _num_experts(config), int(config.num_experts_per_tok)
    device = router_logits[0].device
    counts = torch.zeros(experts + 2, dtype=torch.float64, device=device)  # C_e, N, K
    probs_sum = torch.zeros(experts, dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        if mask is None:
            counts[:experts] += torch.bincount(chosen.reshape(-1), minlength=experts).to(torch.float64)
            counts[experts] += probs.shape[0]
            probs_sum = probs_sum + probs.sum(dim=0)
        else:
            weights = mask.repeat_interleave(top_k).to(torch.float64)
            counts[:experts] += torch.bincount(chosen.reshape(-1), weights=weights, minlength=experts)
            counts[experts] += mask.sum().to(torch.float64)
            probs_sum = probs_sum + (probs * mask.unsqueeze(-1)).sum(dim=0)
    counts[experts + 1] = scored.to(torch.float64)
    reduce = getattr(model, REDUCE_ATTR, None)
    if reduce is not None:
        reduce(counts)
    rows, targets = counts[experts].clamp_min(1.0), counts[experts + 1]
    shares = (counts[:experts] / rows).to(probs_sum.dtype)  # C_e / N over the whole global micro-batch
    weight = (targets / rows).to(probs_sum.dtype)  # K / N: the term adds up to aux · K over the ranks
    return experts * (shares * probs_sum).sum() * weight
