"""A model's per-layer load-balancing loss under pipeline stages: each stage backpropagates its own layers' terms.

zeroshard's GPT with MoE adds ``aux_loss_coef × mean over layers of aux_sum`` to its token-loss sum
(zeroshard/models/gpt.py): a sum of one term per MoE layer, each from that layer's own routing. So
the loss splits exactly by stage: a stage's share is ``aux_loss_coef / layers × Σ aux_sum`` over its
blocks. torch's schedule applies the loss function to the last stage's output only; every other
stage runs its backward from the grad of its output. The share therefore rides on the stage's
output: an identity whose backward also gives the share its grad (the loss scale), so it is
backpropagated inside the stage's own backward, by torch's schedule, with nothing added to it.

Transformers' ``output_router_logits`` loss is not of this form (one E·Σ f_e·P_e over every layer's
tokens at once) and stays refused under pp (layout.py).
"""

from __future__ import annotations

import torch
from torch import nn


class _SeedTerm(torch.autograd.Function):
    """``output`` unchanged; its backward also gives ``term`` the grad ``weight``."""

    @staticmethod
    def forward(ctx, output, term, weight):  # type: ignore[override]
        ctx.weight = weight
        return output.detach()  # the same values, not a view: torch detaches a stage's output in place

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, ctx.weight, None  # d(backpropagated loss) / d(share): the loss scale


class StageAuxLoss:
    """The load-balancing share of one stage of a GPT with MoE: its MoE layers' terms."""

    def __init__(self, stage: nn.Module, coef: float, layers_in_model: int) -> None:
        from zeroshard.models.gpt import MoEMLP

        self.layers = [m for m in stage.modules() if isinstance(m, MoEMLP)]
        self.weight = coef / layers_in_model
        self.scale = torch.ones(())
        """The run's loss scale (set by the pipeline before each schedule run)."""
        self.total: torch.Tensor | None = None
        """Detached sum of the shares since the last ``take``: the stage's part of the reported loss."""

    def attach(self, output: torch.Tensor) -> torch.Tensor:
        terms = [m.aux_sum for m in self.layers if m.aux_sum is not None]
        if not terms:
            return output
        share = self.weight * torch.stack(terms).sum()
        value = share.detach().double()
        self.total = value if self.total is None else self.total + value
        return _SeedTerm.apply(output, share, self.scale.to(share.dtype).to(share.device))

    def take(self) -> torch.Tensor | None:
        """The shares summed since the last call (None when no forward ran one)."""
        total, self.total = self.total, None
        return total


def stage_aux_loss(model: nn.Module, stage: nn.Module) -> StageAuxLoss | None:
    """The stage's share of ``model``'s load-balancing loss, or None when the model has none."""
    from zeroshard.models.gpt import GPT, MoEMLP

    coef = float(getattr(getattr(model, "cfg", None), "aux_loss_coef", 0.0))
    if not isinstance(model, GPT) or not coef:
        return None
    layers = sum(isinstance(m, MoEMLP) for m in model.modules())
    return StageAuxLoss(stage, coef, layers) if layers else None
