"""Every transformers model: its spec derived from what its config and class declare.

transformers 5 ships, on most decoder configs, the plans its own distributed code applies:
``base_model_tp_plan`` (module pattern -> tensor-parallel style), ``base_model_ep_plan`` (the
experts and how they are dispatched) and ``base_model_pp_plan`` (the modules in forward order, the
blocks among them), all relative to the base model (``model.base_model_prefix``). The spec is those
plans with the prefix put in front, plus what the model's own modules show: the blocks' ModuleList,
the head, the param-free modules every stage needs. No architecture is named here.
"""

from __future__ import annotations

from typing import Any, Mapping, cast

from torch import nn

from zeroshard.models.spec import ModelSpec
from zeroshard.runtime.tp_plan import COLUMN_STYLES, SHARED_TAIL, matches

EXPERTS_STYLE = "ep_dispatch_experts"
"""transformers' ep-plan style on a module of stacked experts."""
HEAD_SIZES = ("num_attention_heads", "num_key_value_heads")


def is_transformers_model(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "base_model_tp_plan") and hasattr(model, "base_model_prefix")


def _prefixed(prefix: str, plan: Any) -> dict[str, Any]:
    return {f"{prefix}{key}": value for key, value in dict(plan or {}).items()}


def _blocks(model: nn.Module, prefix: str, pp_plan: dict[str, Any]) -> str | None:
    """The base model's ModuleList of blocks: the pp plan's, else the one holding the no-split modules."""
    modules = dict(model.named_modules())
    for name in pp_plan:
        if isinstance(modules.get(name), nn.ModuleList):
            return name
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(n, m) for n, m in modules.items() if isinstance(m, nn.ModuleList) and len(m) and n.startswith(prefix)]
    for name, module in lists:
        if type(next(iter(module.children()))).__name__ in no_split:
            return name
    return max(lists, key=lambda item: len(item[1]))[0] if lists else None


def _conversions(model: nn.Module) -> list[Any]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # a transformers without conversion mappings converts nothing
        return []
    return list(get_model_conversion_mapping(cast(Any, model), add_legacy=False) or [])


def _divides(model: nn.Module, config: Any, styles: Mapping[str, str], blocks: str) -> dict[str, int]:
    """The config's sizes the split must divide: the heads where attention is split, the MLP width
    where a projection of that width is split column-wise (``styles``: per block, experts left out)."""
    out: dict[str, int] = {}
    planned = {n: (s, m) for block in model.get_submodule(blocks).children() for n, m in block.named_modules()
               for p, s in styles.items() if n and matches(n, p)}
    if any("attn" in n or "attention" in n for n in planned):
        out.update({k: getattr(config, k) for k in HEAD_SIZES if isinstance(getattr(config, k, None), int)})
    width = getattr(config, "intermediate_size", None)
    for style, module in planned.values():
        weight = getattr(module, "weight", None)
        if isinstance(width, int) and style in COLUMN_STYLES and weight is not None and weight.dim() == 2 and \
                weight.shape[0] in (width, 2 * width):
            out["intermediate_size"] = width
            break
    return out


def _sequence(model: nn.Module, blocks: str, styles: Mapping[str, str]) -> tuple[tuple[str, ...], str]:
    """The block's norms (what runs on the sequence-split stream), or why sequence parallelism is refused:
    a child of a block that holds params, is not a norm and has nothing split (an MoE block)."""
    norms: list[str] = []
    for block in model.get_submodule(blocks).children():
        planned = [n for n, _ in block.named_modules() if n and any(matches(n, p) for p in styles)]
        for name, child in block.named_children():
            if not any(True for _ in child.parameters()) or any(p == name or p.startswith(name + ".") for p in planned):
                continue
            if "norm" not in type(child).__name__.lower():
                return (), (f"sequence parallelism with {type(model).__name__} is not supported: its blocks' {name} "
                            f"({type(child).__name__}) needs the whole sequence on every tp rank; call "
                            "zs.tensor_parallel without sequence_parallel")
            norms.append(name) if name not in norms else None
    return tuple(norms), ""


def _order(model: nn.Module, prefix: str, pp_plan: dict[str, Any], blocks: str, head: str | None
           ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules before and after the blocks: the pp plan's order, else the base model's children
    that hold params, in the order they were registered."""
    order = list(pp_plan) or [f"{prefix}{n}" for n, m in model.get_submodule(prefix.rstrip(".")).named_children()
                              if f"{prefix}{n}" == blocks or any(True for _ in m.parameters())] if prefix else list(pp_plan)
    if blocks not in order:
        return (), ((head,) if head else ())
    at = order.index(blocks)
    return tuple(order[:at]), tuple(order[at + 1:]) + ((head,) if head else ())


def hf_spec(model: nn.Module) -> ModelSpec | None:
    """The spec of a transformers model, from its config's plans; None when no blocks are found."""
    config: Any = getattr(model, "config")
    base = getattr(model, "base_model_prefix", "")
    prefix = f"{base}." if base and hasattr(model, base) else ""
    pp_plan = _prefixed(prefix, getattr(config, "base_model_pp_plan", None))
    blocks = _blocks(model, prefix, pp_plan)
    if blocks is None:
        return None
    name = type(model).__name__
    tp_plan = _prefixed(prefix, getattr(config, "base_model_tp_plan", None))
    ep_plan = _prefixed(prefix, getattr(config, "base_model_ep_plan", None))
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head_module = get_head() if callable(get_head) else None
    head = next((n for n, m in model.named_modules() if head_module is not None and m is head_module), None)
    before, after = _order(model, prefix, pp_plan, blocks, head)
    base_module = model.get_submodule(base) if prefix else model
    shared = tuple(f"{prefix}{n}" for n, m in base_module.named_children()
                   if f"{prefix}{n}" not in pp_plan and not any(True for _ in m.parameters()))
    experts = tuple(p for p, style in ep_plan.items() if style == EXPERTS_STYLE)
    spec = ModelSpec(name=name, blocks=blocks, tp_plan=tp_plan, experts=experts)
    split = spec.tp().styles if tp_plan else {}  # what tp splits in each block (the experts left whole)
    norms, sequence_refusal = _sequence(model, blocks, split) if tp_plan else ((), "")
    return ModelSpec(
        name=name, blocks=blocks, before=before, after=after, shared=shared, tp_plan=tp_plan,
        tp_divides=_divides(model, config, split, blocks),
        # transformers' mla_kv_a_proj reads the shared (rotary) part's size from the config the same way
        tp_tails={p: getattr(config, "qk_rope_head_dim", 0) for p, s in tp_plan.items() if s == SHARED_TAIL},
        tp_refusal="" if tp_plan else (f"{name} declares no tensor-parallel plan (its config's base_model_tp_plan is "
                                       "empty); use tp=1, or pass spec=zs.ModelSpec(..., tp_plan={...})"),
        sequence_norms=norms, sequence_refusal=sequence_refusal, ep_plan=ep_plan, experts=experts,
        no_split=tuple(getattr(model, "_no_split_modules", None) or ()), renames=_conversions)
