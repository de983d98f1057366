"""Ready-made param groups for optimizers that split a model by role (the Muon recipe)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def muon_groups(model: nn.Module, *, muon: dict[str, Any] | None = None, **others: Any) -> list[dict]:
    """``param_groups`` for ``zs.optimizer``: the hidden matrices (weights of ``nn.Linear`` modules)
    to ``torch.optim.Muon`` with the options ``muon``; everything else (embeddings, the output head,
    norms, biases) in a second group for the call's own class (AdamW), with the options ``others``.

    The head is left out of Muon as the Muon authors do: a Linear named ``*head*``, or one whose
    weight is tied to an embedding. Works on a model before or after ``zs.shard`` (by module, not shape).
    """
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.requires_grad and id(module.weight) not in embedded \
                and "head" not in name.rsplit(".", 1)[-1]:
            matrices.append(f"{name}.weight" if name else "weight")
    chosen = set(matrices)
    rest = [n for n, p in model.named_parameters() if p.requires_grad and n not in chosen]
    if not matrices:
        raise ValueError(f"{type(model).__name__} has no nn.Linear matrices for Muon; use AdamW alone")
    return [{"params": matrices, "optimizer": torch.optim.Muon, **(muon or {})}, {"params": rest, **others}]
