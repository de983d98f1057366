"""LoRA adapters on the model `zeroshard train` builds, through peft's own layers.

peft's `inject_adapter_in_model` replaces each target linear layer in place by its LoRA layer
(`q_proj.base_layer.weight` frozen, `q_proj.lora_A.default.weight` and `lora_B` trainable) and
freezes everything else, so the module keeps its class and its forward: the runtime shards it like
any model, with the frozen params in groups of their own that hold only compute-dtype values
(zeroshard/runtime/flat.py). The base is built whole before the adapters go in (a pretrained folder
is read by transformers on each rank), so its values are in place before sharding.
"""

from __future__ import annotations

from typing import Any

from torch import nn

ALL_LINEAR = "all-linear"


def is_adapted(model: nn.Module) -> bool:
    """The model carries peft adapters (its `peft_config`)."""
    return bool(getattr(model, "peft_config", None))


def _require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ValueError("lora_r > 0 needs peft: pip install 'zeroshard[finetune]'") from None
    return peft


def target_modules(model: nn.Module, targets: str) -> list[str]:
    """The module names `targets` picks: all-linear is every nn.Linear but the output head (a layer
    whose weight is an embedding's, or the model's own output embedding), as peft does for HF models."""
    if targets.strip() != ALL_LINEAR:
        return [t.strip() for t in targets.split(",") if t.strip()]
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head
             and id(m.weight) not in embedded and name.rsplit(".", 1)[-1] != "lm_head"]
    if not names:
        raise ValueError("lora_targets='all-linear' found no linear layer but the head; name the modules "
                         "(--lora-targets q_proj,v_proj)")
    return names


def apply_lora(cfg: Any, model: nn.Module) -> nn.Module:
    """`cfg.lora`'s adapters injected into `model` in place (returned); the model as it is when r = 0.
    Every rank builds the same adapters from the same seed (the sharded run also broadcasts rank 0's)."""
    if not cfg.lora.enabled:
        return model
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("LoRA needs the base model built whole; use init = 'full' (or 'auto') with lora_r > 0")
    return inject_lora(model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, targets=cfg.lora.targets)


def inject_lora(model: nn.Module, *, r: int, alpha: float = 16.0, dropout: float = 0.0,
                targets: str = ALL_LINEAR) -> nn.Module:
    """peft's LoRA layers in `model`, in place (on meta too: the planner counts a model it never builds)."""
    peft = _require_peft()
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules(model, targets))
    try:
        return peft.inject_adapter_in_model(config, model)
    except ValueError as e:  # peft's "Target modules {...} not found in the base model"
        raise ValueError(f"lora_targets={targets!r}: {str(e).splitlines()[0]}") from None
