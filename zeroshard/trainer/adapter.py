"""One interface for the models ``zeroshard train`` runs: zeroshard's GPT and Hugging Face causal LMs.

The training loop calls these functions instead of model methods, so an HF model (which takes
``input_ids`` and returns an output object) needs no special case anywhere else.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.lora import is_adapted
from zeroshard.models import hf as hf_models
from zeroshard.models.hf import build_hf_model, hf_loss_sum, init_weights, is_hf_model, token_loss_sum


def is_hf_name(name: str) -> bool:
    """``hf:<name>`` or a local ``save_pretrained`` folder (zeroshard/checkpoint/hf/pretrained.py)."""
    from zeroshard.checkpoint.hf.folder import is_pretrained_folder

    return hf_models.is_hf_name(name) or is_pretrained_folder(name)


def _is_pretrained(model: nn.Module) -> bool:
    from zeroshard.checkpoint.hf.pretrained import PretrainedSpec

    return isinstance(getattr(model, "cfg", None), PretrainedSpec)


def _is_transformers_model(model: nn.Module) -> bool:
    """A transformers model however it was built (its own from_pretrained included): it takes
    input_ids, and its packed-sequence masks need use_cache=False, which hf_loss_sum passes."""
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def is_pretrained_model(model: nn.Module) -> bool:
    """Built from a save_pretrained folder: its values are read from the folder after ``zs.shard``."""
    return _is_pretrained(model)


def loss_sum(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
             positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of per-token losses, tokens counted)``; targets of -100 are left out of both.

    ``positions`` (position_ids restarting at each packed sample) go to the model, which keeps the
    samples apart; None is the plain call. Any other causal LM (a ``module:Class``) either has GPT's
    ``loss_sum(idx, targets)`` or returns logits (or an output with ``.logits``) of shape
    (batch, seq, vocab) from ``model(idx)``."""
    if is_hf_model(model) or (positions is not None and _is_transformers_model(model)):
        return hf_loss_sum(model, idx, targets, positions)
    # nn.Module's __getattr__ is typed for params and submodules; this is the model's method (GPT's).
    loss: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = getattr(model, "loss_sum", None)
    if positions is not None and callable(loss):
        return loss(idx, targets, position_ids=positions)
    if callable(loss):
        return loss(idx, targets)
    if positions is not None and "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"{type(model).__name__} takes no position_ids, so packed samples would attend to "
                         f"each other; use --packing off (or drop --doc-mask)")
    out = model(idx) if positions is None else model(idx, position_ids=positions)
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != targets.shape:
        raise TypeError(f"{type(model).__name__}(ids) returned {type(logits).__name__}"
                        f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else ''}, not logits of shape "
                        f"{(*targets.shape, 'vocab')}; a causal LM returns those, or has loss_sum(ids, targets)")
    return token_loss_sum(logits, targets)


def token_vocab(model: nn.Module) -> int | None:
    """How many token ids ``model`` embeds: its input embedding's rows (a Hugging Face model's own
    ``get_input_embeddings``, else its first ``nn.Embedding``); None when it embeds no tokens."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return None if embedding is None else int(embedding.weight.shape[0])


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence a Hugging Face model's config allows (learned or rotary positions);
    None when it sets none (ALiBi, a module without a config)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def mean_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """The mean token loss, as the single-process reference computes it."""
    if positions is not None:
        total, count = loss_sum(model, idx, targets, positions)
        return total / count
    if is_hf_model(model):
        total, count = hf_loss_sum(model, idx, targets)
        return total / count
    return model(idx, targets)  # GPT's own mean: unchanged numerics for `zeroshard verify`


def num_params(model: nn.Module) -> int:
    """Distinct params (a tied embedding/head counts once); reads shapes only, so meta works."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def shard_kwargs(model: nn.Module) -> dict:
    """Extra ``zs.shard`` arguments a model needs: an hf: model's own init, replayed if on meta."""
    if _is_pretrained(model):
        return {"skip_init": True}  # the values come from the folder, in after_shard
    return {"init_fn": init_weights} if is_hf_model(model) else {}


def after_shard(model: nn.Module, *, whole: nn.Module | None = None, tied: dict[str, str] | None = None) -> None:
    """A model built from a pretrained folder reads its weights now: each rank only its shard. A
    pipeline stage passes ``whole``, the model it was cut from, and its tied copies' names."""
    source = whole if whole is not None else model
    if is_adapted(source):
        return  # built whole by transformers before its adapters went in: its values are in place
    if _is_pretrained(source) and (whole is None or any(p.is_meta for p in whole.parameters())):
        from zeroshard.checkpoint.hf.pretrained import load_pretrained

        load_pretrained(model, getattr(source, "cfg").source, whole=whole, tied=tied)


def build_hf(cfg: TrainConfig, vocab_size: int, device: torch.device, *, allow_meta: bool,
             threshold: int) -> nn.Module:
    """An ``hf:`` model for ``train``, seeded with ``cfg.seed``. ``init="auto"`` builds on meta
    above ``threshold`` params, as for zeroshard's GPT. In train mode unless ``cfg.dropout`` is
    False (eval mode: no dropout), whichever way it was built: from_pretrained returns eval mode,
    from_config train mode, and the sharded run and its reference must agree."""
    assert is_hf_name(cfg.model)
    if not hf_models.is_hf_name(cfg.model):
        model = _build_pretrained(cfg, vocab_size, device, meta=allow_meta)
    else:
        meta = allow_meta and cfg.init == "meta"
        if allow_meta and cfg.init == "auto":
            probe = build_hf_model(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len, seed=cfg.seed,
                                   device=torch.device("cpu"), meta=True)
            meta = num_params(probe) > threshold
        model = build_hf_model(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len, seed=cfg.seed,
                               device=device, meta=meta)
    return model.train(cfg.dropout)


def dropout_settings(model_name: str) -> dict[str, float]:
    """The dropout probabilities above 0 a model's config asks for (``attn_pdrop``,
    ``hidden_dropout_prob``, ...), read from a pretrained folder's config.json without building
    it; {} for zeroshard's GPT and the built-in hf: models, which have none."""
    from zeroshard.checkpoint.hf.folder import CONFIG, is_pretrained_folder

    if not is_pretrained_folder(model_name):
        return {}
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model_name) / CONFIG).read_text())
    except ValueError:
        return {}  # the build reports a broken config.json with its own message
    return {k: float(v) for k, v in sorted(config.items()) if ("dropout" in k or "pdrop" in k)
            and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def _build_pretrained(cfg: TrainConfig, vocab_size: int, device: torch.device, *, meta: bool) -> nn.Module:
    """A pretrained folder: on meta for ``zs.shard`` (filled by ``after_shard``), or loaded whole by
    transformers for the single-process reference."""
    from zeroshard.checkpoint.hf.errors import PretrainedError
    from zeroshard.checkpoint.hf.pretrained import build_pretrained, plain_pretrained

    model = build_pretrained(cfg.model, device) if meta else plain_pretrained(cfg.model, device)
    model_vocab = model.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    if vocab_size > model_vocab:
        raise PretrainedError(f"the data has {vocab_size} token ids but {cfg.model} embeds only {model_vocab}; "
                              f"use --vocab-size <= {model_vocab} or data tokenized for this model")
    return model
