"""Building a Hugging Face model with its params on the meta device and its buffers real.

``torch.device("meta")`` would put the buffers on meta too, losing whatever a module's constructor
computed into them. Moving each param to meta as it is registered keeps the constructor's buffers
and allocates at most one param at a time (briefly, uninitialised); the init code that follows runs
on meta for free.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build a model whose params land on meta while its buffers stay real: each param is moved to
    meta as it is registered, so at most one is ever allocated (briefly, uninitialised) and the
    init code that follows runs on meta for free; buffers keep what the constructor computed."""
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
