"""A causal LM written as a plain nn.Module, for `--model plain_lm:PlainLM` (module:Class): no
Hugging Face config and no loss_sum, only forward(ids) -> logits. Module level so spawned ranks
import it by name."""

from __future__ import annotations

import torch
from torch import nn


class PlainLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                                  nn.Linear(2 * width, width)) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)
