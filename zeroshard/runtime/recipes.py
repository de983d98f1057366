"""Ready-made param groups for optimizers that split a model by role (the Muon recipe)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.runtime.attached import find_engine
from zeroshard.runtime.optim import decays


def muon_groups(model: nn.Module, *, muon: dict[str, Any] | None = None, **others: Any) -> list[dict]:
    """``param_groups`` for ``zs.optimizer``: the hidden matrices (weights of ``nn.Linear`` modules)
    to ``torch.optim.Muon`` with the options ``muon``; everything else for the call's own class
    (AdamW) with the options ``others``: embeddings and the output head in one group, norms and
    biases in another without weight decay (the rule of ``zs.optim_groups``).

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
    if not matrices:
        raise ValueError(f"{type(model).__name__} has no nn.Linear matrices for Muon; use AdamW alone")
    engine = find_engine(model)
    # A sharded model's params are flat pieces; the shapes that decide decay are the layout's.
    shapes = {s.fqn: s.shape for g in engine.groups for s in g.layout.slots} if engine is not None else {}
    rest = [(n, shapes.get(n, p.shape)) for n, p in model.named_parameters() if p.requires_grad and n not in chosen]
    groups = [{"params": matrices, "optimizer": torch.optim.Muon, **(muon or {})},
              {"params": [n for n, shape in rest if decays(n, shape)], **others},
              {"params": [n for n, shape in rest if not decays(n, shape)], **others, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
