"""Where a model keeps its blocks, and which of its other modules the first and the last stage keep.

``blocks_path`` is the one place that says where the blocks are: a path the user gives, zeroshard's
GPT's own, or what a Hugging Face model declares (its config's ``base_model_pp_plan`` names the
blocks' ``ModuleList`` under ``base_model_prefix``; a model without a plan: the one ``ModuleList``
of ``num_hidden_layers`` modules in its base model). ``layout_of`` then places the modules outside
the blocks by where the model registers them: a module with params registered before the blocks
(on the path from the root down to them) runs before them and stays on the first stage (the
embeddings), one registered after stays on the last (final norm, head). Modules without params
(rotary tables, dropout) run on every stage. A model that registers a module on the other side of
where it runs is caught when a stage runs it (zeroshard/parallel/pipeline/own_forward.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Layout:
    blocks: str
    """Dotted path of the blocks' ModuleList."""
    first: tuple[str, ...]
    """Modules with params that run before the blocks: only the first stage keeps them."""
    last: tuple[str, ...]
    """Modules with params that run after the blocks: only the last stage keeps them."""
    count: int
    """How many blocks there are."""
    widths: tuple[int, ...] = ()
    """The output width of each of ``first`` (read before any sharding reshapes its params): the
    stand-ins other stages run in its place give tensors of that width."""


def _module_list(model: nn.Module, path: str) -> nn.ModuleList | None:
    try:
        found = model.get_submodule(path)
    except AttributeError:
        return None
    return found if isinstance(found, nn.ModuleList) and len(found) > 0 else None


def blocks_path(model: nn.Module, user_blocks: str | None = None) -> str:
    """The dotted path of ``model``'s blocks (a ``ModuleList``), or a one-line error saying how to name it."""
    name = type(model).__name__
    if user_blocks:
        if _module_list(model, user_blocks) is None:
            raise ValueError(f"blocks={user_blocks!r} is not a non-empty ModuleList of {name}; give the dotted path "
                             "of the list that holds its blocks (e.g. 'transformer.h')")
        return user_blocks
    from zeroshard.models.specs import find_spec

    spec = find_spec(model)  # the model family's own spec: zeroshard's GPT's, a transformers model's, a user's
    found = spec.blocks if spec is not None and _module_list(model, spec.blocks) is not None else None
    if found is None:
        raise ValueError(f"zeroshard cannot tell where {name} keeps its blocks; give their dotted path "
                         "(Pipeline(..., blocks='transformer.h'), --pp-blocks, or [pipeline] blocks), or use pp=1")
    return found


def layout_of(model: nn.Module, user_blocks: str | None = None) -> Layout:
    """Where ``model``'s blocks are and which stage keeps each of its other modules with params."""
    path = blocks_path(model, user_blocks)
    first: list[str] = []
    last: list[str] = []
    heads = path.split(".")
    module, prefix = model, ""
    for depth, head in enumerate(heads):
        held = [n for n, _ in module.named_parameters(recurse=False)]
        if held:
            raise ValueError(f"{type(model).__name__} holds param {prefix}{held[0]} outside any module of its own, "
                             "which no pipeline stage can place; wrap it in a submodule or use pp=1")
        side = first
        for child_name, child in module.named_children():
            if child_name == head:
                side = last
                continue
            if any(True for _ in child.parameters()):
                side.append(prefix + child_name)
        module, prefix = cast(nn.Module, module._modules[head]), f"{prefix}{head}."  # noqa: SLF001
    return Layout(blocks=path, first=tuple(first), last=tuple(last), count=len(cast(nn.ModuleList, module)),
                  widths=tuple(_width(model.get_submodule(p)) for p in first))


def _width(module: nn.Module) -> int:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[-1])
    return int(next(module.parameters()).shape[-1])


def block_names(layout: Layout) -> list[str]:
    return [f"{layout.blocks}.{i}" for i in range(layout.count)]


def hidden_width(model: nn.Module, layout: Layout) -> int:
    """The width of the hidden states sent between stages: the config's, else the token embedding's."""
    for config, key in ((getattr(model, "config", None), "hidden_size"), (getattr(model, "cfg", None), "n_embd")):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    for path in layout.first:
        for module in model.get_submodule(path).modules():
            if isinstance(module, nn.Embedding):
                return module.embedding_dim
    raise ValueError(f"zeroshard cannot tell the hidden width of {type(model).__name__}: no config.hidden_size and no "
                     "nn.Embedding before its blocks; use pp=1 for this model")


def vocab_rows(model: nn.Module, layout: Layout) -> int:
    """The logits' width: the output embedding's rows (the head)."""
    get = getattr(model, "get_output_embeddings", None)
    head: Any = get() if callable(get) else None
    if head is None:
        heads = [m for path in layout.last for m in model.get_submodule(path).modules()
                 if isinstance(getattr(m, "weight", None), nn.Parameter) and getattr(m, "weight").dim() == 2]
        head = heads[-1] if heads else None
    if head is None:
        raise ValueError(f"zeroshard cannot find {type(model).__name__}'s output head after its blocks; "
                         "use pp=1 for this model")
    return int(head.weight.shape[0])


def refuse_router_loss(model: nn.Module) -> None:
    """transformers' router load-balancing loss is one term over every layer's tokens at once, which
    no stage holds: refused (zeroshard's GPT's per-layer terms split by stage, aux_loss.py)."""
    from zeroshard.models.router_aux import router_aux_coef

    if router_aux_coef(model):
        raise ValueError(f"{type(model).__name__}'s config asks for its routers' load-balancing loss "
                         "(output_router_logits), which pipeline stages do not compute yet; set "
                         "output_router_logits to false in its config or use pp=1")
