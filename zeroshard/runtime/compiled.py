"""torch.compile and the sharded runtime: which parts run compiled and which always run eagerly.

``zs.shard(model, compile=...)`` compiles each unit's ``forward`` (the blocks; the root's forward
when the model has none). The runtime's hooks stay outside every graph: they gather and swap
params, launch collectives and keep Python state, none of which belongs in a graph, so they are
wrapped in ``torch.compiler.disable`` (FSDP2 skips its hooks the same way). A compiled forward
then sees the same param objects, with the same shapes, every step: no graph breaks inside a
block and no recompiles. docs/compile.md lists what is supported and what is refused.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Mapping, TypeVar, Union

import torch
from torch import nn

F = TypeVar("F", bound=Callable)

CompileArg = Union[None, bool, str, Mapping[str, Any]]
"""``zs.shard(compile=)``: False/None (eager), True (inductor), a backend name, or torch.compile kwargs."""

_COMPILE_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")


class CompileError(ValueError):
    """A torch.compile use the sharded runtime does not support; the message names the fix."""


def eager_hook(fn: F) -> F:
    """``fn`` (a runtime hook) always runs eagerly, also when a compiled frame calls it."""
    return torch.compiler.disable(fn, recursive=True)


def refuse_traced(what: str) -> None:
    """Raise from inside a frame dynamo is tracing: as a disabled function this call is a graph
    break, so it runs eagerly and the user gets this error instead of a silent fallback to eager.

    Wrapped when called, not at import: ``torch.compiler.disable`` imports dynamo, a second or
    more of every process's start (each rank, each ``zeroshard`` command) that runs nothing
    compiled. A frame dynamo is tracing has dynamo imported already."""
    if "torch._dynamo" not in sys.modules:
        raise CompileError(what)
    _disabled_raise()(what)


@functools.cache
def _disabled_raise() -> Callable[[str], None]:
    def raise_error(what: str) -> None:
        raise CompileError(what)

    return torch.compiler.disable(raise_error)


def compile_options(arg: CompileArg) -> dict[str, Any] | None:
    """torch.compile kwargs for ``zs.shard(compile=arg)``, or None for no compilation."""
    if arg is None or arg is False:
        return None
    if arg is True:
        return {}
    if isinstance(arg, str):
        _check_backend(arg)
        return {"backend": arg}
    if isinstance(arg, Mapping):
        unknown = sorted(set(arg) - set(_COMPILE_KEYS))
        if unknown:
            raise CompileError(f"compile={dict(arg)!r} has unknown keys {unknown}; use any of {list(_COMPILE_KEYS)}")
        if isinstance(arg.get("backend"), str):
            _check_backend(arg["backend"])
        return dict(arg)
    raise CompileError(f"compile={arg!r} is invalid; use True (inductor), a backend name such as 'aot_eager', "
                       "or a dict of torch.compile arguments")


def _check_backend(name: str) -> None:
    known = set(torch.compiler.list_backends(exclude_tags=())) | {"inductor", "eager", "aot_eager"}
    if name not in known:
        raise CompileError(f"compile backend {name!r} is not registered with torch.compile; use one of "
                           f"{sorted(known)}")


def refuse_compiled_wrapper(model: nn.Module) -> None:
    """``torch.compile(model)`` returns a wrapper whose params are named ``_orig_mod.*``; sharding it
    would give every unit, checkpoint key and ledger entry that prefix."""
    dynamo = sys.modules.get("torch._dynamo")  # a wrapper exists only once dynamo is imported
    if dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule):
        raise CompileError("zs.shard got a torch.compile wrapper; shard the model itself, then compile it "
                           "(model.compile() after zs.shard, or zs.shard(model, ..., compile=True))")


def compile_forwards(modules: list[nn.Module], options: dict[str, Any]) -> None:
    """Replace each module's ``forward`` with a compiled one; its hooks stay outside the graph.

    ``forward``, not ``module.compile()``: that compiles ``_call_impl`` and so would trace through
    the runtime's hooks, and a checkpointed unit (zeroshard/runtime/recompute.py) must wrap the
    compiled forward, not be traced itself.
    """
    for module in modules:
        if _is_compiled(module.forward):
            raise CompileError(f"{type(module).__name__}.forward is already compiled; pass compile= to zs.shard or "
                               "compile the blocks yourself, not both")
        module.forward = torch.compile(module.forward, **options)  # type: ignore[method-assign]


def _is_compiled(fn: Callable) -> bool:
    # torch.compile returns a wrapper carrying the original callable under this attribute.
    return hasattr(fn, "_torchdynamo_orig_callable")
