"""The model families zeroshard knows: its own GPT, written by hand, and every transformers model,
derived from its config, or a spec a user attached (zeroshard/models/spec.py): ``find_spec``."""

from __future__ import annotations

import dataclasses

from torch import nn

from zeroshard.models.spec import DERIVED_ATTR, SPEC_ATTR, ModelSpec
from zeroshard.runtime.tp_plan import TPPlan


def derive(model: nn.Module) -> ModelSpec | None:
    """The spec of zeroshard's GPT, or one derived from a transformers model's config; None otherwise."""
    from zeroshard.models.gpt import GPT

    if isinstance(model, GPT):
        from zeroshard.models.specs.gpt import gpt_spec

        return gpt_spec(model)
    from zeroshard.models.specs.hf import hf_spec, is_transformers_model

    return hf_spec(model) if is_transformers_model(model) else None


def find_spec(model: nn.Module) -> ModelSpec | None:
    """The model's spec (attached, zeroshard's GPT's, or derived from a transformers config), or None."""
    own = getattr(model, SPEC_ATTR, None)
    if isinstance(own, ModelSpec):
        return own
    derived = getattr(model, DERIVED_ATTR, None)
    if isinstance(derived, ModelSpec):
        return derived
    spec = derive(model)
    if spec is not None:  # kept: an export asks once per tensor, and a model's modules do not change
        object.__setattr__(model, DERIVED_ATTR, spec)
    return spec


def spec_of(model: nn.Module) -> ModelSpec:
    """``find_spec``, or a one-line error saying how to give the model one."""
    spec = find_spec(model)
    if spec is None:
        raise ValueError(f"zeroshard has no spec for {type(model).__name__}: it is neither zeroshard's GPT nor a "
                         "transformers model; pass spec=zs.ModelSpec(blocks='<path of the blocks ModuleList>', "
                         "tp_plan={'<path>.*.<linear>': 'colwise', ...}) (docs/model_specs.md)")
    return spec


NAMED_TP_PLANS = ("gpt", "llama")
"""The plan names offline tools list (``ckpt reshard --tp-plan``); any transformers ``model_type``
whose config declares a plan is accepted too."""


def named_tp_plan(name: str) -> TPPlan:
    """The tensor-parallel plan of a family known by name, as tools without a model read it: "gpt"
    (zeroshard's GPT) or a transformers ``model_type`` ("llama", "mistral", ...), derived from a
    one-block build of its default config on the meta device."""
    from zeroshard.models.specs.gpt import gpt_plan_by_name

    if name == "gpt":
        return gpt_plan_by_name()
    unknown = ValueError(f"unknown tensor-parallel plan {name!r}; use one of {', '.join(NAMED_TP_PLANS)}, or the "
                         "model_type of a transformers model whose config declares a tensor-parallel plan")
    try:
        import torch
        import transformers as tf

        config = tf.AutoConfig.for_model(name, num_hidden_layers=1)
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
    except (ImportError, ValueError, KeyError):
        raise unknown from None
    spec = derive(model)
    if spec is None or spec.tp_refusal:
        raise unknown
    return dataclasses.replace(spec.tp(), divides={})
