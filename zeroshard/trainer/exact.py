"""The near-exact answer of a run: the single-process reference in float64.

`zeroshard verify` holds a distributed fp32 run to one fp32 process. The two differ only in
summation order, which stays far below 1e-5 for most models. On a few, AdamW turns that rounding
into visible steps: an element whose grad is 1e-5 of its tensor's largest has ``m / sqrt(v)`` of
order one either way, and its sign is set by the last bits. There the fp32 reference is itself
that far from the exact answer, and a distributed run can be nearer to it than the reference is.
The float64 run settles which: rounding 2^29 times smaller, the same data, schedule and optimizer.

A model's own upcasts (a norm's ``x.float()``, softmax's ``dtype=torch.float32``) would cut the
float64 run back to fp32 inside; ``Float64Mode`` keeps them in float64.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.train import build_data, build_model, reference_train


class Float64Mode(TorchFunctionMode):
    """Inside it, float32 means float64: ``.float()``, ``.to(torch.float32)`` and ``dtype=torch.float32``
    all give float64, so a float64 model keeps no fp32 island."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def float64_reference(cfg: TrainConfig, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """``reference_train`` in float64: {"params": float64 state dict, "losses": per step}.

    ``model``: a test's own (as for ``reference_train``); it is cast to float64 in place."""
    if model is None:
        model = build_model(cfg, build_data(cfg).vocab_size, torch.device("cpu"), allow_meta=False)
    model = model.double()
    with Float64Mode():
        losses = reference_train(cfg, model)["losses"]
    # reference_train's own params are cast to fp32; the float64 ones are the point here.
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}
