"""Which DCP keys are model params, which are optimizer state, and which are neither.

A DCP directory records, next to each flattened key, the path it had in the nested state dict
(``metadata.planner_data``, e.g. ``("optim", "state", "layers.0.w", "exp_avg")``). FSDP2 users save
``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}`` (the ``get_state_dict``
conventions of torch.distributed.checkpoint.state_dict), or put the model's keys at the top level
(torchtitan). Both are read here from those paths, so a param name with dots in it is never split
by guessing. Only tensors are read: DCP stores other values (optimizer param groups, scheduler
state) pickled, and this package never unpickles checkpoint data.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.tensorfile import Sized

MODEL_ROOTS = ("model",)
OPTIM_ROOTS = ("optim", "optimizer")
METADATA_FILE = ".metadata"


@dataclasses.dataclass(frozen=True)
class Tensor(Sized):
    """One DCP tensor: its flattened key, full shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass
class DCPLayout:
    """A DCP directory's tensors, sorted by role."""

    path: Path
    model: dict[str, Tensor]
    """Model FQN -> tensor (params and persistent buffers alike: DCP does not tell them apart)."""
    state: dict[str, dict[str, Tensor]]
    """Model FQN -> optimizer state name -> elementwise tensor (the param's shape)."""
    scalars: dict[str, dict[str, Tensor]]
    """Model FQN -> optimizer state name -> 0-dim tensor (AdamW's ``step``)."""
    ignored: list[str]
    """Keys not moved: pickled values (param groups, scheduler, ...) and tensors of no known role."""


def read_metadata(path: str | os.PathLike) -> Metadata:
    directory = Path(path)
    if not directory.exists():
        raise CheckpointError(f"{directory} does not exist; give the directory dcp.save wrote")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is a file, not a directory; give the directory dcp.save wrote")
    if not (directory / METADATA_FILE).is_file():
        raise CheckpointError(f"{directory} is not a torch.distributed.checkpoint directory (it has no "
                              f"{METADATA_FILE} file); give the directory dcp.save wrote")
    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is reported as one line
        raise CheckpointError(f"{directory / METADATA_FILE} cannot be read ({type(e).__name__}: {e}); "
                              "the checkpoint is corrupt or from an incompatible torch") from None


def _path_of(metadata: Metadata, key: str) -> tuple[Any, ...]:
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    path = paths.get(key)
    if isinstance(path, (tuple, list)) and path:
        return tuple(path)
    # Saved without flattening (flat keys given by hand): take the root from the key itself; an
    # optimizer key's rest ("state.<fqn>.<name>") is then resolved against the model's names.
    root, _, rest = key.partition(".")
    return (root, rest) if rest and root in MODEL_ROOTS + OPTIM_ROOTS else (key,)


def read_layout(path: str | os.PathLike, *, buffers: tuple[str, ...] = ()) -> tuple[DCPLayout, set[str]]:
    """Sort a DCP directory's keys. Returns the layout and the model FQNs matching a ``buffers`` glob."""
    directory = Path(path)
    metadata = read_metadata(directory)
    tensors, paths, ignored = {}, {}, []
    for key, info in metadata.state_dict_metadata.items():
        if isinstance(info, TensorStorageMetadata):
            tensors[key] = Tensor(key, tuple(info.size), info.properties.dtype)
            paths[key] = _path_of(metadata, key)
        else:
            ignored.append(key)
    nested = any(p[0] in MODEL_ROOTS for p in paths.values())
    model: dict[str, Tensor] = {}
    optim: list[tuple[str, tuple[Any, ...]]] = []
    for key, p in paths.items():
        if p[0] in OPTIM_ROOTS and len(p) > 1:
            optim.append((key, p[1:]))
        elif nested and p[0] in MODEL_ROOTS and len(p) > 1:
            model[".".join(str(x) for x in p[1:])] = tensors[key]
        elif not nested and len(p) == 1:
            model[key] = tensors[key]
        else:
            ignored.append(key)
    if not model:
        raise CheckpointError(f"{directory} holds no model tensors (keys: {sorted(metadata.state_dict_metadata)[:5]}); "
                              "expected dcp.save({'model': model_state_dict, ...}) or the model's keys at the top level")
    layout = DCPLayout(directory, model, {}, {}, ignored)
    for key, p in optim:
        _place_optim(layout, tensors[key], p)
    matched = {fqn for fqn in model if any(fnmatch.fnmatchcase(fqn, g) for g in buffers)}
    for glob in buffers:
        if not any(fnmatch.fnmatchcase(fqn, glob) for fqn in model):
            raise CheckpointError(f"--buffers {glob!r} matches no model tensor in {directory}; "
                                  f"model tensors are named like {next(iter(model))!r}")
    return layout, matched


def _state_target(layout: DCPLayout, p: tuple[Any, ...]) -> tuple[str, str] | None:
    """(param FQN, state name) of an optimizer key path, in either of get_optimizer_state_dict's forms."""
    if len(p) == 3 and p[0] == "state":  # nested: ("state", fqn, name)
        return str(p[1]), str(p[2])
    if len(p) == 1 and str(p[0]).startswith("state."):  # flatten_optimizer_state_dict: "state.<fqn>.<name>"
        rest = str(p[0])[len("state."):]
        owners = [fqn for fqn in layout.model if rest.startswith(fqn + ".")]
        if owners:
            fqn = max(owners, key=len)
            return fqn, rest[len(fqn) + 1:]
    return None


def _place_optim(layout: DCPLayout, tensor: Tensor, p: tuple[Any, ...]) -> None:
    target = _state_target(layout, p)
    if target is None:
        layout.ignored.append(tensor.key)  # param_groups' tensors, or a layout we do not know
        return
    fqn, name = target
    param = layout.model.get(fqn)
    if param is None:
        raise CheckpointError(f"{layout.path}: optimizer state {tensor.key!r} belongs to {fqn!r}, which is not "
                              "among the model's tensors; the optimizer state was saved for another model")
    if tensor.shape == ():
        layout.scalars.setdefault(fqn, {})[name] = tensor
    elif tensor.shape == param.shape:
        layout.state.setdefault(fqn, {})[name] = tensor
    else:
        raise CheckpointError(f"{layout.path}: optimizer state {tensor.key!r} has shape {list(tensor.shape)} but its "
                              f"param {param.key!r} has {list(param.shape)}; only elementwise state (the param's "
                              "shape) and scalars can move to zeroshard")
