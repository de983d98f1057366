"""Checkpoint names (and layouts) that transformers converts on load, in both directions.

Some architectures' checkpoints keep names or layouts the model class no longer uses: GPT-NeoX's
head is ``embed_out`` in the files and ``lm_head`` in the model; a Mixtral folder stores each
expert's projections apart (``block_sparse_moe.experts.3.w1.weight``) where the model holds them
stacked (``mlp.experts.gate_up_proj``). transformers converts them as it loads, by its conversion
mapping, and back as ``save_pretrained`` writes. zeroshard reads that same mapping off the model
(``get_model_conversion_mapping``) and runs transformers' own conversion ops, so a folder loads
whatever its layout and an export is written in the layout the folder had.

A renamed tensor is read by element range like any other. A merged param is built whole from its
file tensors on every rank (each rank then keeps its slice): for such a param, a rank reads all of
its experts, not 1/N of them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn

from zeroshard.checkpoint.hf.errors import PretrainedError


def _conversions(model: Any) -> list[Any]:
    """The model's conversions, as its spec holds them (zeroshard/models/spec.py: transformers' own
    mapping for a transformers model, none for a model whose spec declares none)."""
    from zeroshard.models.specs import find_spec

    spec = find_spec(model)
    return [] if spec is None or spec.renames is None else list(spec.renames(model))


@dataclasses.dataclass
class Merge:
    """One model param built from several file tensors by a transformers converter."""

    converter: Any
    sources: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(file tensor name, the converter's source pattern it matched), in the files' natural order."""

    def build(self, target: str, read: Callable[[str], torch.Tensor], model: Any) -> torch.Tensor:
        """The param's whole value: each source read with ``read``, then the converter's ops."""
        converter = copy.deepcopy(self.converter)
        for name, pattern in self.sources:
            converter.add_tensor(target, name, pattern, read(name))
        out = converter.convert(target, model=model, config=getattr(model, "config", None))
        if target not in out:
            raise PretrainedError(f"transformers' conversion of {[n for n, _ in self.sources][:2]}... gave "
                                  f"{sorted(out)}, not {target}")
        value = out[target]
        return value[0] if isinstance(value, list) else value


@dataclasses.dataclass
class FileNames:
    renamed: dict[str, str]
    """Model name -> file tensor name, for tensors transformers renames on load."""
    merged: dict[str, Merge]
    """Model name -> the file tensors it is built from."""


def file_names(model: nn.Module, files: Iterable[str]) -> FileNames:
    """How the model's names map onto a folder's tensors, where transformers converts them (names
    the model shares with the files are left out)."""
    out = FileNames({}, {})
    conversions = _conversions(model)
    if not conversions:
        return out
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    own = set(model.state_dict(keep_vars=True))
    for name in sorted((n for n in files if n not in own), key=dot_natural_key):
        target, pattern = rename_source_key(name, renamings, converters)
        if pattern is not None:
            out.merged.setdefault(target, Merge(by_pattern[pattern])).sources.append((name, pattern))
        elif target != name:
            out.renamed[target] = name
    return out


def _revert(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def saved_tensors(model: nn.Module, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for the model's tensor ``name``: itself under its own name,
    under the folder's name if transformers renames it, or the file tensors a merged param is split
    back into. Works on meta tensors too (names and shapes only)."""
    if not _conversions(model):
        return {name: value}
    return dict(_revert(model, {name: value}))


def saved_tensors_of_config(config: dict[str, Any]) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``saved_tensors`` for a model known by its config.json alone (an offline checkpoint export):
    the model is built with params on meta, only to read its conversion mapping."""
    import transformers as tf

    from zeroshard.checkpoint.hf.meta import params_on_meta

    fields = {k: v for k, v in config.items() if k != "model_type"}
    with params_on_meta():
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(config["model_type"], **fields))
    return lambda name, value: saved_tensors(model, name, value)
