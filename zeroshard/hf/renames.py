"""Checkpoint names that transformers renames on load, in both directions.

Some architectures' checkpoints keep names the model class no longer uses (GPT-NeoX's head is
``embed_out`` in the files and ``lm_head`` in the model); transformers renames them as it loads,
by its conversion mapping, and back as ``save_pretrained`` writes. zeroshard reads that same
mapping off the model (``get_model_conversion_mapping``), so a folder loads whatever its naming and
an export is written in the naming the folder had.

Only renamings are followed. A converter that builds one param out of several tensors (an MoE's
experts stacked into one) changes values, not only names: such a folder is refused by name, since
reading it would need every expert whole on every rank.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from zeroshard.hf.errors import PretrainedError


def _conversions(model: Any) -> list[Any]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # a transformers without conversion mappings renames nothing
        return []
    return list(get_model_conversion_mapping(model, add_legacy=False) or [])


def file_names(model: nn.Module, files: Iterable[str]) -> dict[str, str]:
    """Model name -> file tensor name, for each file tensor transformers renames on load (names it
    keeps are left out). A file tensor a converter would merge into another is refused by name."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = _conversions(model)
    if not conversions:
        return {}
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    own = set(model.state_dict(keep_vars=True))
    out: dict[str, str] = {}
    for name in files:
        if name in own:
            continue
        renamed, merged_by = rename_source_key(name, renamings, converters)
        if merged_by is not None:
            raise PretrainedError(f"tensor {name} is merged with others into {renamed} by transformers' conversion "
                                  "mapping for this architecture (its experts or projections are stored apart); "
                                  "zeroshard reads renamed tensors only, not merged ones")
        if renamed != name:
            out[renamed] = name
    return out


def saved_name(model: nn.Module, name: str) -> str:
    """The name ``save_pretrained`` writes for the model's ``name``: its renamings reversed."""
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    reverse = [c.reverse_transform() for c in _conversions(model)[::-1]]
    return apply_renamings(name, [c for c in reverse if isinstance(c, WeightRenaming)])


def saved_names_of_config(config: dict[str, Any]) -> Any:
    """``saved_name`` for a model known by its config.json alone (an offline checkpoint export): the
    model is built with params on meta, only to read its conversion mapping."""
    import transformers as tf

    from zeroshard.hf.meta import params_on_meta

    fields = {k: v for k, v in config.items() if k != "model_type"}
    with params_on_meta():
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(config["model_type"], **fields))
    return lambda name: saved_name(model, name)
