"""What a model family is, as data: one ``ModelSpec`` per family, read by every parallel dim.

A spec says where the blocks are (the dotted path of one ``nn.ModuleList``), which modules run
before and after them and which param-free ones every pipeline stage needs, how tensor
parallelism splits it (fqn pattern -> style, transformers' vocabulary: zeroshard/runtime/tp_plan.py),
where its experts are and how expert parallelism splits them, and how its checkpoint names convert.
The planner reads activations from the model itself (a traced forward), not from the spec. Nothing
else in the package keys on a model's class.

``zeroshard.models.specs.spec_of(model)`` finds it:

1. a spec the user attached (``zs.tensor_parallel(model, spec=...)`` attaches it; ``attach``);
2. zeroshard's own GPT: the spec written by hand in zeroshard/models/specs/gpt.py;
3. any transformers model: derived from what its config declares (``base_model_tp_plan``,
   ``base_model_ep_plan``, ``base_model_pp_plan``, ``_no_split_modules``), so every architecture
   with plans works with no line of zeroshard for it (zeroshard/models/specs/hf.py).

A model none of these covers is refused in one line that says how to write a spec. docs/model_specs.md
has an example for a nanoGPT-shaped model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from torch import nn

from zeroshard.runtime.tp_plan import TPPlan, matches

SPEC_ATTR = "_zeroshard_spec"
"""Where ``attach`` keeps a user's spec on the model."""
DERIVED_ATTR = "_zeroshard_derived_spec"
"""Where ``find_spec`` keeps the spec it derived."""

MOE_TP_STYLES = ("moe_tp_experts", "moe_identity_expert")
"""Styles transformers puts on an experts module: zeroshard keeps the experts whole on each tp rank
(expert parallelism splits them over ep instead), which computes the same function."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model family. Every pattern is a dotted path from the model's root; ``*`` matches one name."""

    blocks: str
    """Dotted path of the ``nn.ModuleList`` whose children are the blocks (``"model.layers"``)."""
    name: str = "model"
    """The family, as errors and reports name it."""
    before: tuple[str, ...] = ()
    """Modules that run before the blocks (embeddings): a pipeline's first stage keeps them."""
    after: tuple[str, ...] = ()
    """Modules that run after the blocks (final norm, head): the last stage keeps them."""
    shared: tuple[str, ...] = ()
    """Param-free modules every stage needs (rotary tables)."""
    tp_plan: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Module pattern -> tensor-parallel style (zeroshard/runtime/tp_plan.py lists them)."""
    tp_chunks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """A column-split entry that stacks several projections by rows (fused q/k/v: 3) -> how many."""
    tp_divides: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Sizes tp must divide (heads, kv heads, MLP width), by the names the errors use."""
    tp_tails: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """An ``mla_kv_a_proj`` entry -> how many of its output's last features every head reads (the rotary key part)."""
    tp_refusal: str = ""
    """Why this family has no tensor-parallel plan (empty when it has one)."""
    sequence_norms: tuple[str, ...] = ()
    """Children of a block that run on the sequence-split stream under sequence parallelism."""
    sequence_refusal: str = ""
    """Why sequence parallelism is refused (empty: allowed)."""
    stream_inputs: bool = True
    """An attention's (or MLP's) split projections share one reduction of their input grad."""
    ep_plan: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Pattern -> expert-parallel style (transformers' ``base_model_ep_plan``)."""
    experts: tuple[str, ...] = ()
    """Patterns of the modules holding stacked experts (dim 0 = expert)."""
    expert_layers: Callable[[nn.Module], list] | None = None
    """Hook for expert parallelism: the model's MoE layers, as zeroshard/parallel/experts/ reads them."""
    no_split: tuple[str, ...] = ()
    """Class names of modules never cut apart (transformers' ``_no_split_modules``)."""
    renames: Callable[[nn.Module], list] | None = None
    """The model's checkpoint conversions (transformers' conversion mapping), or None for none."""

    def tp(self) -> TPPlan:
        """The tensor-parallel plan as the runtime takes it (zeroshard/runtime/tp.py): the entries under
        the blocks per block, the rest from the root; entries on experts kept whole (see MOE_TP_STYLES)."""
        if self.tp_refusal:
            raise ValueError(self.tp_refusal)
        inner, outer, chunks = {}, {}, {}
        prefix = self.blocks + ".*."
        for pattern, style in self.tp_plan.items():
            if style in MOE_TP_STYLES or self.on_experts(pattern):
                continue
            if pattern.startswith(prefix):
                inner[pattern[len(prefix):]] = style
            else:
                outer[pattern] = style
        for pattern, n in self.tp_chunks.items():
            chunks[pattern[len(prefix):] if pattern.startswith(prefix) else pattern] = n
        tails = {pattern[len(prefix):] if pattern.startswith(prefix) else pattern: n for pattern, n in self.tp_tails.items()}
        return TPPlan(blocks=self.blocks, styles=inner, outer=outer, chunks=chunks, divides=dict(self.tp_divides),
                      tails=tails,
                      sequence_norms=self.sequence_norms, sequence_refusal=self.sequence_refusal,
                      stream_inputs=self.stream_inputs, name=self.name)

    def on_experts(self, pattern: str) -> bool:
        """Whether ``pattern`` is an experts module or lies inside one."""
        parts = pattern.split(".")
        return any(matches(".".join(parts[:len(e.split("."))]), e) for e in self.experts
                   if len(parts) >= len(e.split(".")))


def attach(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """Make ``spec`` the model's own: every later ``spec_of(model)`` returns it."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a zeroshard ModelSpec, got {type(spec).__name__}; build one with "
                        "ModelSpec(blocks='transformer.h', tp_plan={...})")
    object.__setattr__(model, SPEC_ATTR, spec)  # not a submodule or param: a plain attribute
    return model


def with_overrides(spec: ModelSpec, **changes: Any) -> ModelSpec:
    """``spec`` with some fields replaced (a user's own TP plan over a derived spec)."""
    return dataclasses.replace(spec, **changes)
