"""``zs.tensor_parallel``: split a model over the mesh's tp dim by its spec (zeroshard/models/spec.py).

The runtime takes the plan as data (zeroshard/runtime/tp.py); this is where the model's spec is read:
zeroshard's GPT's, one derived from a transformers config, or one the caller passes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroshard.models.spec import ModelSpec, attach
from zeroshard.models.specs import spec_of
from zeroshard.runtime import tp as runtime_tp


def tensor_parallel(model: nn.Module, spec: ModelSpec | None = None, *, sequence_parallel: bool = False,
                    mesh: Any = None, plan: Any = None) -> nn.Module:
    """Split ``model``'s blocks across the mesh's "tp" dim (``zs.init(tp=N)``), in place; then ``zs.shard`` it.

    ``spec``: the model's family (``zs.ModelSpec``): where its blocks are and how each is split. By
    default the model's own: zeroshard's GPT has one, and a transformers model's is derived from its
    config's ``base_model_tp_plan``. A spec passed here is attached to the model, so the pipeline and
    the checkpoint code read the same one. ``plan``: a ``TPPlan`` (or ``plan(model, tp)`` returning
    one) instead of a spec. See ``zeroshard.runtime.tp.tensor_parallel`` for the rest.
    """
    if plan is None:
        if spec is not None:
            attach(model, spec)
        plan = spec_of(model).tp()
    return runtime_tp.tensor_parallel(model, plan, sequence_parallel=sequence_parallel, mesh=mesh)


def check_tensor_parallel(model: nn.Module, tp: int, *, sequence_parallel: bool = False) -> None:
    """Whether ``model``'s spec can split it over ``tp`` ranks, changing nothing (a meta model will do);
    a ValueError names the problem and the fix."""
    runtime_tp.check_plan(model, spec_of(model).tp(), tp, sequence_parallel=sequence_parallel)
