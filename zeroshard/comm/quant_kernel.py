"""The int8 codec's fused quantize: one compiled (inductor) loop instead of ~7 eager passes.

Eager blockwise quantization walks the data about seven times (copy, |x|, amax, scale, round,
clamp, cast): ~4-6 ns per element on one CPU core, which at stage 3 costs more CPU than the
transport it saves over fast links. The same ops compiled by ``torch.compile`` (inductor) run as
one fused loop per block (~0.5 ns per element, measured by bench/quant_speed.py --codec-only). The
ops and their order are the eager codec's, and the output is bitwise the same (tested).

The kernel is compiled once per input dtype, with dynamic shapes (groups have different block
counts; none of them recompiles), on the first call with at least ``COMPILE_MIN_NUMEL`` elements:
smaller tensors stay eager, where the seconds of a compile buy nothing. If compiling fails (no C++
compiler for inductor on CPU, no triton on GPU), the codec warns once, naming the reason, and stays
eager for the rest of the process. ``ZEROSHARD_QUANT_CODEC=eager`` skips compiling altogether.
``codec_name()`` says which ran (the precision manifest records it).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode  # no public equivalent

QMAX = 127
COMPILE_MIN_NUMEL = 1 << 18
"""Elements below which a quantize call stays eager (tiny groups: compile time would dominate)."""
MODES = ("auto", "eager")
ENV = "ZEROSHARD_QUANT_CODEC"


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (blocks x block_size, any float dtype) -> (int8 values, fp32 scale ``absmax / 127`` per block).

    Written once for both paths: eager it is the reference, compiled it is the fused kernel. An
    all-zero block has scale 0 and multiplies by 0 (zeros, not NaN); multiplying by the reciprocal is
    cheaper than a broadcast divide."""
    x = x.to(torch.float32)
    scales = x.abs().amax(dim=1) / QMAX
    inverse = torch.where(scales > 0, scales.reciprocal(), 0.0)
    return (x * inverse.unsqueeze(1)).round().clamp(-QMAX, QMAX).to(torch.int8), scales


def quantize_blocks_into(x: torch.Tensor, out: torch.Tensor, scales_out: torch.Tensor) -> None:
    """``quantize_blocks`` stored into ``out`` / ``scales_out``: compiled, the kernel writes the wire
    buffers directly (no fresh int8 buffer and copy per call)."""
    q, scales = quantize_blocks(x)
    out.copy_(q)
    scales_out.copy_(scales)


class Codec:
    """Process-wide: the compiled kernel (built lazily) and what the codec ran as."""

    def __init__(self) -> None:
        self.kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        self.failed: str | None = None
        self.compiled_calls = 0
        self.eager_calls = 0
        """Large calls that went eager anyway: under a TorchDispatchMode (torch's MemTracker, a
        FlopCounter) dynamo does not run compiled code, and a compiled call there would make it skip
        the kernel for the rest of the process; those calls alone go eager."""

    def mode(self) -> str:
        mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
        if mode not in MODES:
            raise ValueError(f"{ENV}={mode!r} is invalid; use one of {', '.join(MODES)}")
        return mode

    def usable(self, numel: int) -> bool:
        return numel >= COMPILE_MIN_NUMEL and self.failed is None and self.mode() == "auto"

    def run(self, x: torch.Tensor, out: torch.Tensor, scales_out: torch.Tensor) -> bool:
        """Quantize ``x`` into ``out`` / ``scales_out`` with the compiled kernel; False when it cannot (then
        the caller goes eager)."""
        if is_in_torch_dispatch_mode():
            self.eager_calls += 1
            return False
        try:
            if self.kernel is None:
                self.kernel = torch.compile(quantize_blocks_into, dynamic=True, fullgraph=True)
            with torch.no_grad():
                self.kernel(x, out, scales_out)
        except Exception as exc:  # noqa: BLE001 - any backend failure means: stay eager, say why
            if self.compiled_calls:
                self.eager_calls += 1
                return False
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            warnings.warn(f"int8 codec: torch.compile of the quantize kernel failed ({self.failed}); "
                          f"quantizing eagerly (same bits, slower)", RuntimeWarning, stacklevel=3)
            return False
        self.compiled_calls += 1
        return True


_CODEC = Codec()


def compiled_quantize(x: torch.Tensor, out: torch.Tensor, scales_out: torch.Tensor) -> bool:
    """``quantize_blocks_into`` through the compiled kernel when ``x`` is large enough and compiling
    works; False otherwise (nothing written: the caller quantizes eagerly)."""
    return _CODEC.usable(x.numel()) and _CODEC.run(x, out, scales_out)


def codec_name() -> str:
    """What the quantize ran as in this process so far, or will run as: for the manifest and logs."""
    if _CODEC.mode() == "eager":
        return f"eager ({ENV}=eager)"
    if _CODEC.failed is not None:
        return f"eager (compile failed: {_CODEC.failed})"
    if _CODEC.compiled_calls:
        declined = f", {_CODEC.eager_calls} under a dispatch mode ran eager" if _CODEC.eager_calls else ""
        return (f"inductor (compiled, {_CODEC.compiled_calls} calls{declined}; "
                f"eager below {COMPILE_MIN_NUMEL} elements)")
    if torch.cuda.is_available() or shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++"):
        return f"inductor on first use of >= {COMPILE_MIN_NUMEL} elements (eager below)"
    return "eager (no C++ compiler found for inductor)"
