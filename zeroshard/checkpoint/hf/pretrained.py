"""Load a ``save_pretrained`` folder straight into a sharded model.

    model = zs.build_pretrained(path)          # AutoConfig + from_config on meta; real buffers
    zs.shard(model, stage=3, skip_init=True)      # only this rank's shards are allocated
    zs.load_pretrained(model, path)               # each rank reads only what it holds

[Note: what each rank reads]
The engine lays each unit's params into one flat buffer; a rank holds ``[group.lo, group.hi)`` of
it (the whole buffer at stage 0, 1/N at stages 1-3). For every param inside that range we read
exactly those elements from the safetensors file (``FolderReader.read_range``), convert them to
the master dtype (bf16 files into fp32 masters) and copy them into the shard; then the engine
publishes the masters to the compute params as after a checkpoint load. No rank ever holds more
than its shard plus one slice being copied.

A param split by tensor parallelism is the exception: each rank of its tp group reads the whole
tensor and keeps its tp part (``zeroshard.runtime.tp.to_local``), then the shard of that part.

Tied weights: a tied LM head is one param registered under two names; the files hold it under one
of them (save_pretrained drops the tied copy), so any of the param's names may supply it.
Buffers: the model is built with its params on meta but its buffers real, so every buffer holds
what the model's own constructor wrote (a table set in a module's ``__init__`` included). Persistent
buffers are then read from the files; the rest are not state, so the model's per-module init
recomputes those it knows (rotary ``inv_freq``) and the constructor's values stand for the others.
transformers' ``from_pretrained`` leaves a non-persistent buffer its ``_init_weights`` does not
cover uninitialised, so ``plain_pretrained`` restores those from the same constructor build.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard.runtime import tp as tp_layout
from zeroshard.runtime.expert_placement import expert_rows
from zeroshard.checkpoint.hf.errors import PretrainedError
from zeroshard.checkpoint.hf.folder import CONFIG, FolderReader, is_pretrained_folder
from zeroshard.checkpoint.hf.meta import params_on_meta
from zeroshard.checkpoint.hf.renames import FileNames, Merge, file_names
from zeroshard.models.hf import HFSpec, require_transformers

__all__ = ["PretrainedSpec", "build_pretrained", "is_pretrained_folder", "load_pretrained", "plain_pretrained"]


@dataclasses.dataclass(frozen=True)
class PretrainedSpec(HFSpec):
    """``model.cfg`` of a model built from a folder: also where it came from (for export)."""

    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "source": self.source}


def _read_config(folder: Path) -> Any:
    tf = require_transformers()
    path = folder / CONFIG
    if not path.is_file():
        raise PretrainedError(f"{path} is missing; point --model at a folder written by save_pretrained")
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except ValueError as e:
        raise PretrainedError(f"{path} is not valid JSON ({e})") from e
    if model_type not in tf.CONFIG_MAPPING:
        raise PretrainedError(f"{path}: model_type {model_type!r} is not an architecture transformers "
                              f"{tf.__version__} knows; upgrade transformers or fix model_type")
    return tf.AutoConfig.from_pretrained(str(folder), local_files_only=True)


def _build(folder: Path, config: Any) -> Any:
    tf = require_transformers()
    try:
        with params_on_meta():
            return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as e:
        first = str(e).strip().splitlines()[0]
        raise PretrainedError(f"{folder / CONFIG}: transformers has no causal LM for {config.model_type!r} "
                              f"({first})") from e


def build_pretrained(path: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """The causal LM of a pretrained folder with params on meta (for ``zs.shard(skip_init=True)``)
    and buffers on ``device`` (the mesh's) as its constructor wrote them; ``load_pretrained`` then
    reads the persistent ones from the files. fp32 params, whatever the files hold."""
    folder = Path(path)
    config = _read_config(folder)
    model = _build(folder, config)
    model.cfg = PretrainedSpec(name=str(folder), config=config.to_dict(), source=str(folder.resolve()))
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:  # made from a param (on meta now): the per-module init computes it
                raise PretrainedError(f"{folder}: buffer {name!r} of {type(module).__name__} is computed from a param "
                                      "in its constructor; this architecture needs a custom loader")
            # Assigning to a registered buffer's name keeps it registered, persistence and all.
            setattr(module, name, moved.setdefault(id(buf), buf.to(device)))
    return model


def _constructor_buffers(model: nn.Module, folder: Path, config: Any) -> None:
    """Non-persistent buffers as the constructor writes them, where from_pretrained left others:
    its per-module init recomputes those it knows (rotary tables) and leaves the rest as allocated."""
    built = dict(_build(folder, config).named_buffers())
    persistent = set(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name not in persistent and name in built and not torch.equal(buf.cpu(), built[name]):
                buf.copy_(built[name])


def plain_pretrained(path: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """The same model loaded whole in one process by transformers (fp32): the reference that a
    sharded load must equal."""
    tf = require_transformers()
    folder = Path(path)
    config = _read_config(folder)
    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=torch.float32,
                                                    local_files_only=True).to(device)
    _constructor_buffers(model, folder, config)
    model.cfg = PretrainedSpec(name=str(folder), config=config.to_dict(), source=str(folder.resolve()))
    return model


def _plan(engine, reader: FolderReader, names: FileNames, model: nn.Module,
          tied: dict[str, str]) -> list[tuple[Any, int, str, Merge | None]]:
    """(group, param index, file tensor name or merged param name, Merge or None) for every param;
    checks names and shapes first (a merged param's on meta tensors), so a bad folder is refused
    before any value is written. ``names``: where transformers converts the model's names;
    ``tied``: a param's other name, for a pipeline stage's own copy of a tied param."""
    plan = []
    for group in engine.groups:
        for index, (slot, ref) in enumerate(zip(group.layout.slots, group.refs)):
            aliases = sorted(ref.aliases) + sorted(tied[n] for n in ref.aliases if n in tied)
            found = [n for n in aliases if n in reader.weight_map] or [names.renamed[n] for n in aliases
                                                                       if n in names.renamed]
            merged = next((n for n in aliases if n in names.merged), None)
            if not found and merged is None:
                raise PretrainedError(f"{reader.folder}: no tensor for param {' / '.join(aliases)} "
                                      "in the safetensors files; the folder is from a different model")
            merge: Merge | None = None
            if found:
                name, what = found[0], f"tensor {found[0]}"
                shape, where = reader.shape(name), reader.where(name)
            else:
                assert merged is not None
                name, merge = merged, names.merged[merged]
                shape = merge.build(name, lambda n: torch.empty(reader.shape(n), device="meta"), model).shape
                where, what = str(reader.folder), f"{name}, merged from {merge.sources[0][0]} and the rest,"
            spec = group.tp_specs[index]
            # An expert param: the whole stack's shape; a tp-split param: its full shape.
            expected = spec.shape if _tp_split(spec) else expert_rows(group.mesh, slot.shape)[0]
            if shape != expected:
                raise PretrainedError(f"{where}: {what} has shape {list(shape)}, the model expects "
                                      f"{list(expected)}; config.json and weights disagree")
            plan.append((group, index, name, merge))
    return plan


def _tp_split(spec: Any) -> bool:
    """A param split over tp (``TPSpec``): the files hold it whole, a rank reads all of it and keeps its part."""
    return spec is not None and spec.shard_dim is not None


def _fill_buffers(model: nn.Module, reader: FolderReader, renamed: dict[str, str], init_module: Any) -> None:
    """Persistent buffers from the files; the rest from the model's per-module init
    (``init_module``) where it has one for them, else as the constructor wrote them (``build_pretrained``)."""
    for module_name, module in model.named_modules():
        buffers = dict(module.named_buffers(recurse=False))
        if callable(init_module) and buffers and not list(module.parameters(recurse=False)):
            # transformers' per-module init computes derived buffers (rotary tables) from the
            # config; modules with params are skipped, so no loaded value is touched.
            init_module(module)
        for name, buf in buffers.items():
            key = f"{module_name}.{name}" if module_name else name
            key = key if key in reader.weight_map else renamed.get(key, key)
            if key in reader.weight_map:
                with torch.no_grad():
                    buf.copy_(reader.read(key).reshape(buf.shape))


def load_pretrained(model: nn.Module, path: str | Path, *, whole: nn.Module | None = None,
                    tied: dict[str, str] | None = None) -> dict[str, Any]:
    """Fill a sharded model (``zs.shard(..., skip_init=True)`` of ``build_pretrained(path)``) from
    the folder: each rank reads only the elements it holds. Returns ``bytes_held`` (the values
    copied into this rank's shard), ``bytes_read`` (the rows read for them) and ``tensors``.
    A pipeline stage (zeroshard/pipeline) passes ``whole``, the model it was cut from (whose class
    says how transformers renames the files' tensors), and ``tied``: its copy of a tied param's
    name -> the owner's, either of which the files may hold it under."""
    from zeroshard.runtime import get_engine

    engine = get_engine(model)
    reader = FolderReader(path)
    held = 0
    whole = model if whole is None else whole
    try:
        names = file_names(whole, reader.weight_map)
        plan = _plan(engine, reader, names, whole, tied or {})
        for group, index, name, merge in plan:
            slot = group.layout.slots[index]
            start, stop = max(slot.offset, group.lo), min(slot.end, group.hi)
            if start >= stop:
                continue
            spec = group.tp_specs[index]
            if _tp_split(spec):  # this tp rank's part of the whole tensor, in its flat order
                full = reader.read(name) if merge is None else merge.build(name, reader.read, model)
                local = tp_layout.to_local(full.reshape(spec.shape), spec.describe(), spec.mesh.get_local_rank())
                values = local.reshape(-1)[start - slot.offset:stop - slot.offset]
                held += values.numel() * values.element_size()
                with torch.no_grad():
                    group.shard[start - group.lo:stop - group.lo].copy_(values)
                continue
            # An expert param (expert parallelism) is this rank's block of rows of the file's tensor.
            _, block = expert_rows(group.mesh, slot.shape)
            a, b = block + start - slot.offset, block + stop - slot.offset
            if merge is None:
                values = reader.read_range(name, a, b)
            else:  # built whole from its file tensors by transformers' ops, then this rank's slice
                values = merge.build(name, reader.read, model).reshape(-1)[a:b]
            held += values.numel() * values.element_size()
            with torch.no_grad():
                group.shard[start - group.lo:stop - group.lo].copy_(values)
        _fill_buffers(model, reader, names.renamed, init_module=getattr(whole, "_init_weights", None))
    finally:
        reader.close()
    if engine.policy.shard_params:
        for unit in engine.units:
            unit.reshard()  # a unit gathered before the load holds stale values
    engine.sync_params()
    engine.zero_grad()
    engine.values_loaded_from(f"pretrained folder {path}")  # what train's summary reports
    return {"bytes_held": held, "bytes_read": reader.bytes_read, "tensors": len(plan)}
