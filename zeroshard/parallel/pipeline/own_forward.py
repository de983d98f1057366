"""One pipeline stage that runs the model's own forward, cut at block boundaries.

torch's tracer (``torch.distributed.pipelining.pipeline``) cannot capture Hugging Face forwards
(their masks and caches break ``torch.export``) and renames the params, so a stage instead calls the
whole model's own top-level forward on a copy of its module tree in which:

- the blocks the stage does not own are pass-throughs (param-free), and on a stage other than the
  last the block after its last one ends the forward, handing on what the model passes to that
  block: the stage's output;
- on a stage other than the first, the hidden state received from the previous stage replaces the
  input of its first block (a pre-hook on that block), so whatever the model computed before it
  from a stand-in embedding is discarded;
- the modules with params outside the blocks are kept by the first stage (before the blocks) or the
  last (after), and are stand-ins elsewhere (layout.py places them).

So embedding scales, masks (per-layer sliding windows), rotary tables, the final norm and logit
soft-capping all come from the model's own code. The kept modules are the model's own, at the
paths they have in the whole model, so ``named_parameters()`` gives the unsharded model's names.
The loss is not part of a stage: torch's schedule applies it to the last stage's logits
(zeroshard/parallel/pipeline/runtime.py).
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from zeroshard.parallel.pipeline.layout import Layout


class _StageEnd(Exception):
    """Raised by the block after a stage's last one: the forward ends with ``hidden``, the stage's output."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage end")
        self.hidden = hidden


class _Passed(torch.Tensor):
    """What a skipped block returns: indexing gives itself back, so a model that unpacks a block's
    output (``hidden = block(...)[0]``) and one that takes it whole both pass it on unchanged."""

    def __getitem__(self, index: Any) -> _Passed:  # type: ignore[override]
        return self


def _hidden_arg(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


class _Skip(nn.Module):
    """A block another stage owns, before this stage's: passes its input on (it is replaced later)."""

    def __init__(self, stage: StageModule) -> None:
        super().__init__()
        object.__setattr__(self, "stage", stage)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cast(StageModule, self.stage).in_blocks = True
        hidden = _hidden_arg(args, kwargs)
        return hidden.as_subclass(_Passed) if isinstance(hidden, torch.Tensor) else hidden


class _End(nn.Module):
    """A block after this stage's last: the stage's output is what the model passes to it."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = _hidden_arg(args, kwargs)
        if not isinstance(hidden, torch.Tensor):
            raise ValueError("a block of this model takes no hidden-state tensor first (or as hidden_states); "
                             "pipeline stages cannot hand on its input")
        # torch's zero-bubble schedules detach a stage's output in place, which a view refuses: a copy then.
        raise _StageEnd(hidden.clone() if hidden._is_view() else hidden)  # noqa: SLF001


class _Before(nn.Module):
    """A module with params that runs before the blocks, on a stage other than the first: token ids
    in, zeros of the embedding's width out (a stand-in: the received hidden state replaces it)."""

    def __init__(self, stage: StageModule, path: str, width: int) -> None:
        super().__init__()
        object.__setattr__(self, "stage", stage)
        self.path, self.width = path, width

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        stage = cast(StageModule, self.stage)
        if stage.in_blocks:
            raise ValueError(f"{self.path} is registered before the blocks but runs after them; pipeline stages "
                             "place modules by where they are registered; use pp=1 for this model")
        x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        if x.is_floating_point():
            return x
        return torch.zeros(*x.shape, self.width, dtype=stage.dummy_dtype, device=x.device)


class _After(nn.Module):
    """A module with params that runs after the blocks, on a stage other than the last: never reached."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"{self.path} is registered after the blocks but runs before them; pipeline stages "
                         "place modules by where they are registered; use pp=1 for this model")


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its children, params and code, with dicts of its own (children
    may then be swapped in the copy only)."""
    out = copy.copy(module)
    for key, value in module.__dict__.items():
        if key.startswith("_") and isinstance(value, (dict, set)):
            out.__dict__[key] = copy.copy(value)
    return out


def _swap(root: nn.Module, path: str, new: nn.Module, copies: set[int]) -> None:
    """Put ``new`` at ``path`` of the copied tree ``root``, copying each module on the way that is
    not a copy yet, so the whole model keeps its own children."""
    parent = root
    *heads, leaf = path.split(".")
    for head in heads:
        child = cast(nn.Module, parent._modules[head])  # noqa: SLF001
        if id(child) not in copies:
            child = _shallow(child)
            copies.add(id(child))
            parent._modules[head] = child  # noqa: SLF001
        parent = child
    parent._modules[leaf] = new  # noqa: SLF001


def _is_hf(model: nn.Module) -> bool:
    """A transformers model: called with ``input_ids=`` and without a cache."""
    return hasattr(model, "config") and isinstance(getattr(model, "base_model_prefix", None), str)


class StageModule(nn.Module):
    """One pipeline stage of ``model``: the blocks ``blocks`` (indices), the modules around them its
    place in the pipeline keeps, and the model's own forward to run them."""

    def __init__(self, model: nn.Module, layout: Layout, blocks: tuple[int, ...], *, stage_index: int,
                 num_stages: int) -> None:
        super().__init__()
        self.layout = layout
        self.stage_index = stage_index
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.hf_config = getattr(model, "config", None)
        self.cfg = getattr(model, "cfg", None)  # what a run records as the model's config
        self.aux_loss: Any = None
        """The stage's share of the model's load-balancing loss (zeroshard/parallel/pipeline/aux_loss.py), or None."""
        self.in_blocks = False
        self.dummy_dtype = torch.float32
        self._received: torch.Tensor | None = None
        self._hf = _is_hf(model)
        root = _shallow(model)
        copies = {id(root)}
        for path, width in () if self.is_first else zip(layout.first, layout.widths):
            _swap(root, path, _Before(self, path, width), copies)
        for path in () if self.is_last else layout.last:
            _swap(root, path, _After(path), copies)
        whole = cast(nn.ModuleList, model.get_submodule(layout.blocks))
        listed = nn.ModuleList(whole[i] if i in blocks else _Skip(self) if i < blocks[0] else _End()
                               for i in range(layout.count))
        _swap(root, layout.blocks, listed, copies)
        self._owned = [whole[i] for i in blocks]
        object.__setattr__(self, "_root", root)  # not a child: its children are this module's own (below)
        # The stage's children, buffers and their names are the copied root's: one tree, the model's names.
        self.__dict__["_modules"] = root._modules  # noqa: SLF001
        self.__dict__["_buffers"] = root._buffers  # noqa: SLF001
        self.__dict__["_non_persistent_buffers_set"] = root._non_persistent_buffers_set  # noqa: SLF001
        if not self.is_first:
            # prepend: ahead of the engine's gather and anything else on the block, which then see the received input
            self._owned[0].register_forward_pre_hook(self._substitute, with_kwargs=True, prepend=True)

    def _substitute(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        received, self._received = self._received, None
        if received is None:  # the whole model's own forward, or another stage's: not this stage's call
            return None
        self.in_blocks = True
        others = [k for k, v in [*enumerate(args[1:], 1), *kwargs.items()] if isinstance(v, _Passed)]
        if others:
            raise ValueError(f"{type(module).__name__} also takes argument {others[0]!r} from the block before it; "
                             "pipeline stages hand on one hidden state, use pp=1 for this model")
        if args:
            return (received, *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise ValueError(f"{type(module).__name__} takes its hidden state neither first nor as hidden_states; "
                             "pipeline stages cannot hand it on, use pp=1 for this model")
        return args, {**kwargs, "hidden_states": received}

    def block_modules(self) -> list[nn.Module]:
        """This stage's blocks: its ZeRO units (zs.shard's ``units``)."""
        return list(self._owned)

    def _call(self, ids: torch.Tensor) -> Any:
        root: nn.Module = self.__dict__["_root"]
        out = root(input_ids=ids, use_cache=False) if self._hf else root(ids)
        out = getattr(out, "logits", out)
        return out[0] if isinstance(out, (tuple, list)) else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or the received hidden state in; the hidden state the next stage's
        first block takes, or (last stage) the model's logits, out."""
        if self.is_first:
            ids = x
        else:
            ids = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
            self._received, self.dummy_dtype = x, x.dtype
        self.in_blocks = False
        try:
            out = self._call(ids)
            if not self.is_last:
                raise ValueError(f"the model's forward returned without running block {self._end_index()}; "
                                 "pipeline stages need a forward that runs every block in order; use pp=1")
        except _StageEnd as end:
            out = end.hidden
        finally:
            received, self._received = self._received, None
        if received is not None:
            raise ValueError(f"the model's forward never ran block {self.layout.blocks}.{self._first_index()}; "
                             "pipeline stages need a forward that runs every block in order; use pp=1")
        if self.is_last and (not isinstance(out, torch.Tensor) or out.dim() != 3):
            raise ValueError(f"the model's forward returned {type(out).__name__}, not logits (batch, seq, vocab); "
                             "a causal LM returns those (or an output with .logits)")
        return out if self.aux_loss is None else self.aux_loss.attach(out)

    def _first_index(self) -> int:
        listed = cast(nn.ModuleList, self.get_submodule(self.layout.blocks))
        return next(i for i, m in enumerate(listed) if m is self._owned[0])

    def _end_index(self) -> int:
        return self._first_index() + len(self._owned)
