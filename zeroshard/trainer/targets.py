"""What `--model` names for `plan`, `plan time`, `plan measure` and `tune`: the model a run will
train, on meta. `tune` takes all but module:Class: it trains its candidates as `zeroshard train`
does, and train builds no module:Class.

  tiny | small | medium    zeroshard's GPT presets, kept as names (the planner knows their layout)
  llama3-8b | llama3-70b   the simulator's Llama shapes (--time only)
  FOLDER                   a save_pretrained folder, built as `zeroshard train` builds it
  hf:NAME                  a Hugging Face model built from a small config in code (hf:gpt2-tiny, hf:llama-tiny)
  module:Class             any nn.Module class (or function returning one), called with the keyword
                           arguments of --model-config (a JSON object, inline or a .json file)

Every model is built with its params on the meta device, so planning allocates nothing. The
step-time simulator reads a transformer's shape off such a model (zeroshard/tools/sim/hf_shape.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

from torch import nn

from zeroshard.models.names import HF_PREFIX, MODEL_NAMES


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A --model that is not a preset, with what it was built with: plain data, so a spawned rank
    (``plan measure``) builds the very model the parent planned."""

    spec: str
    vocab_size: int | None = None
    seq_len: int = 64
    seed: int = 0
    config: str | None = None
    """--model-config, as given (inline JSON or a .json path)."""

    def build(self) -> nn.Module:
        return build_target(self.spec, vocab_size=self.vocab_size, seq_len=self.seq_len, seed=self.seed,
                            config=self.config)


def is_preset(spec: str) -> bool:
    return spec in MODEL_NAMES


def is_module_spec(spec: str) -> bool:
    """``package.module:Name``: a colon with a dotted module path before it (not a folder, not hf:)."""
    head, sep, tail = spec.partition(":")
    return bool(sep) and not spec.startswith(HF_PREFIX) and bool(tail) and all(p.isidentifier() for p in head.split("."))


def model_kwargs(text: str | None) -> dict[str, Any]:
    """--model-config: a JSON object inline, or the path of a .json file holding one."""
    if text is None:
        return {}
    source = Path(text).read_text() if text.endswith(".json") and Path(text).is_file() else text
    try:
        value = json.loads(source)
    except ValueError as e:
        raise ValueError(f"--model-config {text!r} is neither a JSON object nor a .json file holding one ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--model-config must be a JSON object of keyword arguments, got {type(value).__name__}")
    return value


def _from_module(spec: str, kwargs: dict[str, Any]) -> nn.Module:
    from zeroshard.runtime.materialize import meta_init

    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as e:
        raise ValueError(f"--model {spec}: cannot import {module_name!r} ({e}); put it on PYTHONPATH") from None
    except AttributeError:
        raise ValueError(f"--model {spec}: module {module_name!r} has no {attr!r}") from None
    try:
        with meta_init():
            model = factory(**kwargs)
    except TypeError as e:
        raise ValueError(f"--model {spec}: {e}; give its arguments as --model-config '{{\"name\": value}}'") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec} returned {type(model).__name__}, not an nn.Module")
    return model


def build_target(spec: str, *, vocab_size: int | None = None, seq_len: int = 64, seed: int = 0,
                 config: str | None = None) -> nn.Module:
    """The model ``spec`` names, on meta (buffers of a folder's model real, as train builds them)."""
    if config is not None and not is_module_spec(spec):
        raise ValueError(f"--model-config gives a module:Class its arguments; --model {spec} takes none: drop it")
    from zeroshard.checkpoint.hf.folder import is_pretrained_folder

    if vocab_size is not None and not spec.startswith(HF_PREFIX):
        raise ValueError(f"--vocab-size resizes zeroshard's GPT presets and hf: models; {spec} keeps its own "
                         "vocabulary: drop --vocab-size")
    if is_module_spec(spec):
        return _from_module(spec, model_kwargs(config))
    if is_pretrained_folder(spec):
        from zeroshard.checkpoint.hf.pretrained import build_pretrained

        return build_pretrained(spec)
    if spec.startswith(HF_PREFIX):
        import torch

        from zeroshard.models.hf import build_hf_model

        return build_hf_model(spec, vocab_size=vocab_size or 256, seq_len=seq_len, seed=seed, device=torch.device("cpu"),
                              meta=True)
    raise ValueError(f"--model {spec!r} is not a model: give a preset ({', '.join(MODEL_NAMES)}), a save_pretrained "
                     "folder (with config.json), hf:NAME or module:Class")
