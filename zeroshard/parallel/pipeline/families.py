"""How a model family is cut into pipeline stages and how one stage runs.

A *family* names where a model keeps its blocks (one ``ModuleList``), which modules run before
them (embeddings: the first stage keeps them), which after (final norm and head: the last stage),
which every stage needs without owning params (Llama's rotary embedding), and how a stage's
forward chains them. Two families are known: zeroshard's GPT and the Hugging Face decoders whose
blocks are ``model.layers`` (Llama, Qwen2, Mistral). The loss is not part of a stage: torch's
schedule applies it to the last stage's logits (zeroshard/parallel/pipeline/runtime.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, cast

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    blocks: str
    """Dotted path of the blocks' ModuleList."""
    first: tuple[str, ...]
    """Modules only the first stage keeps (the embeddings)."""
    last: tuple[str, ...]
    """Modules only the last stage keeps (final norm, head)."""
    shared: tuple[str, ...]
    """Param-free modules every stage keeps (rotary embedding tables)."""
    forward: Callable[[Any, torch.Tensor], torch.Tensor]
    """``forward(stage_module, x)``: tokens (first stage) or hidden states in, hidden states or logits out."""
    hidden: Callable[[nn.Module], int]
    """The width of the hidden states sent between stages."""


def _gpt_forward(stage: Any, x: torch.Tensor) -> torch.Tensor:
    # The GPT's own _logits, cut at the stage's ends: the same ops, so the numerics are one process's.
    if stage.is_first:
        pos = torch.arange(x.shape[1], device=x.device)  # (T,)
        x = stage.tok_emb(x) + stage.pos_emb(pos)  # (B, T, C)
    for block in stage.blocks:
        x = block(x)  # (B, T, C)
    if stage.is_last:
        x = stage.lm_head(stage.norm_f(x))  # (B, T, V)
    return x


def _hf_decoder_forward(stage: Any, x: torch.Tensor) -> torch.Tensor:
    # LlamaModel.forward without a cache, cut at the stage's ends; mask and rotary tables are rebuilt
    # on every stage (they hold no params and cost one small op each).
    from transformers.masking_utils import create_causal_mask

    inner = stage.model
    hidden = inner.embed_tokens(x) if stage.is_first else x  # (B, T, C)
    position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)
    mask = create_causal_mask(config=stage.hf_config, inputs_embeds=hidden, attention_mask=None, cache=None,
                              position_ids=position_ids)
    position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
    for layer in inner.layers:
        hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                       position_ids=position_ids, use_cache=False)
    if stage.is_last:
        hidden = stage.lm_head(inner.norm(hidden))  # (B, T, V)
    return hidden


GPT_FAMILY = Family(name="gpt", blocks="blocks", first=("tok_emb", "pos_emb"), last=("norm_f", "lm_head"),
                    shared=(), forward=_gpt_forward, hidden=lambda m: int(getattr(m, "cfg").n_embd))
HF_DECODER_FAMILY = Family(name="hf-decoder", blocks="model.layers", first=("model.embed_tokens",),
                           last=("model.norm", "lm_head"), shared=("model.rotary_emb",), forward=_hf_decoder_forward,
                           hidden=lambda m: int(getattr(m, "config").hidden_size))


def family_of(model: nn.Module) -> Family:
    """The model's family, or a one-line error naming the models that can be cut."""
    from zeroshard.models.gpt import GPT

    if isinstance(model, GPT):
        return GPT_FAMILY
    names = {n for n, _ in model.named_modules()}
    if {"model.layers", "model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"} <= names and \
            isinstance(model.get_submodule("model.layers"), nn.ModuleList):
        from zeroshard.models.router_aux import router_aux_coef

        if router_aux_coef(model):  # a stage's loss is the token loss of the last stage's logits
            raise ValueError(f"{type(model).__name__}'s config asks for its routers' load-balancing loss "
                             "(output_router_logits), which pipeline stages do not compute yet; set "
                             "output_router_logits to false in its config or use pp=1")
        return HF_DECODER_FAMILY
    raise ValueError(f"pipeline stages can be cut from zeroshard's GPT and Hugging Face decoders whose blocks are "
                     f"model.layers (Llama, Qwen2, Mistral), not from {type(model).__name__}; use pp=1 for this model")


class StageModule(nn.Module):
    """One pipeline stage: the model's own modules that the stage runs, at their own paths.

    The kept modules are registered under the dotted names they have in the whole model, and the
    blocks' ModuleList keeps each block under its model index (``blocks.2`` stays ``blocks.2``), so
    ``named_parameters()`` gives the unsharded model's names: checkpoints, exports and the
    single-process reference line up without a rename table.
    """

    def __init__(self, model: nn.Module, family: Family, blocks: tuple[int, ...], *, stage_index: int,
                 num_stages: int) -> None:
        super().__init__()
        self.family = family
        self.stage_index = stage_index
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.hf_config = getattr(model, "config", None)
        self.cfg = getattr(model, "cfg", None)  # what a run records as the model's config
        self.aux_loss: Any = None
        """The stage's share of the model's load-balancing loss (zeroshard/parallel/pipeline/aux_loss.py), or None."""
        kept = list(family.shared) + (list(family.first) if self.is_first else [])
        for path in kept:
            self._place(path, model.get_submodule(path))
        all_blocks = cast(nn.ModuleList, model.get_submodule(family.blocks))
        chosen = nn.ModuleList()
        # ModuleList iterates its _modules in insertion order, and names children by their keys.
        for i in blocks:
            chosen._modules[str(i)] = all_blocks[i]  # noqa: SLF001 (keeps the model's index as the name)
        self._place(family.blocks, chosen)
        for path in (family.last if self.is_last else ()):
            self._place(path, model.get_submodule(path))

    def _place(self, path: str, module: nn.Module) -> None:
        parent: nn.Module = self
        *heads, leaf = path.split(".")
        for head in heads:
            if head not in parent._modules:  # noqa: SLF001
                parent.add_module(head, nn.Module())
            parent = parent._modules[head]  # type: ignore[assignment]  # noqa: SLF001
        parent.add_module(leaf, module)

    def block_modules(self) -> list[nn.Module]:
        """This stage's blocks: its ZeRO units (zs.shard's ``units``)."""
        return list(cast(nn.ModuleList, self.get_submodule(self.family.blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.family.forward(self, x)
        return out if self.aux_loss is None else self.aux_loss.attach(out)


def block_names(model: nn.Module, family: Family) -> list[str]:
    return [f"{family.blocks}.{i}" for i in range(len(cast(nn.ModuleList, model.get_submodule(family.blocks))))]
