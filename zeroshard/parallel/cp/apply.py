"""``apply_context_parallel``: a plain model's attention made exact over a sequence split on the cp ranks.

zeroshard's GPT takes the split attention in each block's ``attend`` slot and the global positions
in ``positions``. A transformers model takes it through transformers' own attention-function
registry (``AttentionInterface.register`` and ``config._attn_implementation``, the way DeepSpeed's
Ulysses plugs in): its own code computes the projections, rotary angles (from the global
``position_ids`` a forward pre-hook passes), GQA and sliding windows, then calls ours. No model
code is patched; a model whose attention takes neither path is refused by name.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.parallel.cp import layout
from zeroshard.parallel.cp.attention import check_heads, ring_attention, ulysses_attention

if TYPE_CHECKING:
    from zeroshard.comm.mesh import Mesh
    from zeroshard.models.gpt import GPT

HF_ATTENTION = "zeroshard_cp"
"""The name our attention function is registered under in transformers' AttentionInterface."""

_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""An HF attention module -> the ContextParallel of the model it belongs to (the registered
function is one for every model; the module it is called with says which split applies)."""


class _Documents:
    """Packed samples' document of each position of the whole rows in flight, or None: set by the
    step before each micro-step's forward; each attention call reads it then (a recompute in
    backward keeps what its forward read)."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """One model's split: the mesh whose cp group holds a sequence, and the attention scheme."""

    mesh: Mesh
    scheme: str
    documents: _Documents = dataclasses.field(default_factory=_Documents, compare=False, repr=False)

    @property
    def cp(self) -> int:
        return self.mesh.cp_size

    @property
    def rank(self) -> int:
        return self.mesh.cp_rank

    def positions(self, t: int, device: torch.device | None = None) -> torch.Tensor:
        """The global positions of this rank's ``t`` tokens."""
        return layout.positions(t * self.cp, cp=self.cp, rank=self.rank, scheme=self.scheme, device=device)

    def split(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of whole sequences ``t`` (the data loader's batch: ids or targets)."""
        return layout.split(t, cp=self.cp, rank=self.rank, scheme=self.scheme, dim=dim)

    def pack(self, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Packed samples: from the whole rows' ``position_ids`` (B, seq), restarting in each sample,
        every position's document (a new one wherever a position is not its predecessor's plus one,
        transformers' rule and the GPT's), which the attention masks by; returns this rank's tokens'
        position_ids for the model. None (no packing) clears them."""
        if position_ids is None:
            self.documents.ids = None
            return None
        step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
        self.documents.ids = (step != 1).cumsum(-1)
        return self.split(position_ids)

    def check_seq(self, seq: int) -> None:
        layout.check_seq(seq, cp=self.cp, scheme=self.scheme)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                  window: int | None = None) -> torch.Tensor:
        """(B, H, t, D) this rank's rows of causal attention over the whole sequence."""
        fn = ring_attention if self.scheme == "ring" else ulysses_attention
        return fn(q, k, v, mesh=self.mesh, scale=scale, window=window, documents=self.documents.ids)


def context_of(model: nn.Module) -> ContextParallel | None:
    """The split ``apply_context_parallel`` gave ``model``, or None (whole sequences)."""
    return _OWNERS.get(model)


def share_context(module: nn.Module, ctx: ContextParallel | None) -> None:
    """``module`` (a pipeline stage cut from a model given ``ctx``) splits sequences as its model does."""
    if ctx is not None:
        _OWNERS[module] = ctx


def apply_context_parallel(model: nn.Module, mesh: Mesh, scheme: str = "ring") -> ContextParallel | None:
    """Make ``model``'s attention exact over sequences split on ``mesh``'s cp ranks (before
    ``zs.shard``). Nothing to do at cp 1. One-line ValueError for a scheme that is not one, heads
    Ulysses cannot split, or a model whose attention takes no path zeroshard can split."""
    if mesh.cp_size == 1:
        return None
    if scheme not in layout.CP_SCHEMES:
        raise ValueError(f"cp_attention={scheme!r} is not a scheme; use one of {', '.join(layout.CP_SCHEMES)}")
    ctx = ContextParallel(mesh=mesh, scheme=scheme)
    from zeroshard.models.gpt import GPT

    if isinstance(model, GPT):
        _apply_gpt(model, ctx)
    elif _hf_attention_interface(model):
        _apply_hf(model, ctx)
    else:
        raise ValueError(f"cp={mesh.cp_size}: {type(model).__name__}'s attention takes no path context parallelism can "
                         "split (zeroshard's GPT, or a transformers model whose attention goes through "
                         "transformers' attention interface); use cp=1")
    _OWNERS[model] = ctx
    return ctx


def _apply_gpt(model: GPT, ctx: ContextParallel) -> None:
    from zeroshard.models.gpt import CausalSelfAttention

    if ctx.scheme == "ulysses":
        heads = model.cfg.n_head // ctx.mesh.tp_size  # tp leaves a rank its heads
        check_heads(heads, heads, ctx.cp)
    model.positions = ctx.positions
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            m.attend = ctx.attention


def _hf_attention_interface(model: nn.Module) -> bool:
    """A transformers model whose attention calls the function its config names."""
    return getattr(model, "config", None) is not None and bool(getattr(model, "_supports_attention_backend", False))


def _apply_hf(model: nn.Module, ctx: ContextParallel) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config: Any = model.config
    if ctx.scheme == "ulysses":
        heads = config.num_attention_heads // ctx.mesh.tp_size
        kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // ctx.mesh.tp_size
        check_heads(heads, kv, ctx.cp)
    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    # Our function masks by global positions itself: transformers builds no mask for it.
    AttentionMaskInterface.register(HF_ATTENTION, _no_mask)
    model.set_attn_implementation(HF_ATTENTION)  # type: ignore[operator]  # sets config._attn_implementation
    for m in model.modules():
        _OWNERS[m] = ctx
    model.register_forward_pre_hook(functools.partial(_global_position_ids, ctx), with_kwargs=True)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _global_position_ids(ctx: ContextParallel, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Pass this rank's tokens' global positions, so rotary angles are those of the whole sequence."""
    if kwargs.get("position_ids") is None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        kwargs["position_ids"] = ctx.positions(ids.shape[1], ids.device).unsqueeze(0).expand(ids.shape[0], -1)
    return args, kwargs


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, t, D) in, (B, t, H, D) out, no weights."""
    ctx = _OWNERS.get(module)
    if ctx is None:
        raise RuntimeError(f"{type(module).__name__} calls zeroshard's cp attention but its model was not given "
                           "apply_context_parallel")
    if dropout:
        raise ValueError(f"attention dropout {dropout} under context parallelism is not supported; set the model's "
                         "attention_dropout to 0")
    window = kwargs.get("sliding_window") or None
    out = ctx.attention(query, key, value, scale=scaling, window=window)
    return out.transpose(1, 2).contiguous(), None
