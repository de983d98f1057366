"""``is_dtensor``: a DTensor check that does not import DTensor.

``torch.distributed.tensor`` (DTensor and its parallel styles) costs more than a second of CPU to
import, and most processes never make one: every run without tensor parallelism, the CLI's own
process, each tool. Modules that only need to recognise a DTensor ask here; the ones that build
them (zeroshard/runtime/tp.py) import torch's module where a model is split.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """``isinstance(tensor, DTensor)``; False while DTensor's module is not loaded, since no tensor can be one."""
    module = sys.modules.get(DTENSOR_MODULE)
    return module is not None and isinstance(tensor, module.DTensor)
