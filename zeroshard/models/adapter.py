"""One interface for the models ``zeroshard train`` runs: zeroshard's GPT and Hugging Face causal LMs.

The training loop calls these functions instead of model methods, so an HF model (which takes
``input_ids`` and returns an output object) needs no special case anywhere else.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from zeroshard.config import TrainConfig
from zeroshard.models.hf import build_hf_model, hf_loss_sum, init_weights, is_hf_model, is_hf_name


def loss_sum(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of per-token losses, tokens counted)``; targets of -100 are left out of both."""
    if is_hf_model(model):
        return hf_loss_sum(model, idx, targets)
    # nn.Module's __getattr__ is typed for params and submodules; this is the model's method (GPT's).
    loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = getattr(model, "loss_sum")
    return loss(idx, targets)


def mean_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token loss, as the single-process reference computes it."""
    if is_hf_model(model):
        total, count = hf_loss_sum(model, idx, targets)
        return total / count
    return model(idx, targets)  # GPT's own mean: unchanged numerics for `zeroshard verify`


def num_params(model: nn.Module) -> int:
    """Distinct params (a tied embedding/head counts once); reads shapes only, so meta works."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def shard_kwargs(model: nn.Module) -> dict:
    """Extra ``zs.shard`` arguments a model needs: an hf: model's own init, replayed if on meta."""
    return {"init_fn": init_weights} if is_hf_model(model) else {}


def build_hf(cfg: TrainConfig, vocab_size: int, device: torch.device, *, allow_meta: bool,
             threshold: int) -> nn.Module:
    """An ``hf:`` model for ``train``, seeded with ``cfg.seed``. ``init="auto"`` builds on meta
    above ``threshold`` params, as for zeroshard's GPT."""
    assert is_hf_name(cfg.model)
    meta = allow_meta and cfg.init == "meta"
    if allow_meta and cfg.init == "auto":
        probe = build_hf_model(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len, seed=cfg.seed,
                               device=torch.device("cpu"), meta=True)
        meta = num_params(probe) > threshold
    return build_hf_model(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len, seed=cfg.seed,
                          device=device, meta=meta)
