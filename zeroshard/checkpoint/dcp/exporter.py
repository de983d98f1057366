"""``zeroshard ckpt export-dcp``: a zeroshard checkpoint -> a DCP directory that FSDP2 loads with
``dcp.load``, in the ``get_state_dict`` conventions: ``model.<fqn>`` for every param (under each of
its names, as a tied weight has in FSDP2) and persistent buffer, and ``optim.state.<fqn>.<name>``
for the optimizer state (elementwise tensors, and each param's scalar ``step`` as a 0-dim tensor).
Optimizer param-group options are not written: the FSDP2 optimizer brings its own.

``dcp.save`` takes the whole state dict at once, and its file writer keeps every tensor it has
written until the file is closed (copying any tensor that is a view into a larger storage). So each
tensor is first streamed, one param at a time, from the checkpoint's pieces into a file of its own
in a temporary folder next to OUT, and the state dict handed to ``dcp.save(no_dist=True)`` holds
those files mapped into memory (``torch.from_file``), each its own storage: DCP copies nothing, and
what it keeps are file-backed pages that the kernel can drop, not the process's own memory. The
cost is disk: the temporary folder is the size of the export, and is removed at the end.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.load import PieceReader
from zeroshard.checkpoint.save import commit
from zeroshard.checkpoint.staging import partial_of, refuse_existing
from zeroshard.checkpoint.tensorfile import Entry, TensorFile, parse_dtype
from zeroshard.checkpoint.verify import resolve, verify


@dataclasses.dataclass
class ExportedDCP:
    path: Path
    model_keys: int
    optimizer_keys: int
    bytes: int
    largest_param_bytes: int


@dataclasses.dataclass(frozen=True)
class _Item:
    """One tensor of the export: where it goes in the state dict and where it comes from."""

    entry: Entry
    param: dict | None  # None for a buffer
    kind: str  # "master", "optim.<name>", or the buffer's name


def _items(manifest: dict, where: str, optimizer: bool) -> list[_Item]:
    out: list[_Item] = []
    for param in manifest["params"]:
        shape = tuple(param["shape"])
        out.append(_Item(Entry(f"model/{param['fqn']}", parse_dtype(param["dtype"], where), shape), param, "master"))
        for name in param["state"] if optimizer else []:
            dtype = _state_dtype(where, param, name)
            out.append(_Item(Entry(f"optim/{param['fqn']}/{name}", dtype, shape), param, f"optim.{name}"))
    for buffer in manifest["buffers"]:
        entry = Entry(f"buffer/{buffer['name']}", parse_dtype(buffer["dtype"], where), tuple(buffer["shape"]))
        out.append(_Item(entry, None, buffer["name"]))
    return out


def _state_dtype(where: str, param: dict, name: str) -> torch.dtype:
    if not param["pieces"]:
        return parse_dtype(param["dtype"], where)
    piece = param["pieces"][0]
    opened = TensorFile(Path(where) / piece["file"])
    try:
        return opened.stored(fmt.piece_key(f"optim.{name}", param["fqn"], piece["start"], piece["stop"])).dtype
    finally:
        opened.close()


def _spill(directory: Path, manifest: dict, items: list[_Item], folder: Path) -> int:
    """Write each item's values to ``folder/<i>``, one param at a time; returns the largest param's bytes."""
    largest = max((i.entry.nbytes for i in items if i.param is not None), default=0)
    scratch = torch.empty(largest, dtype=torch.uint8)
    buffers = {b["name"]: b for b in manifest["buffers"]}
    reader = PieceReader(directory, manifest)
    try:
        for index, item in enumerate(items):
            if item.param is None:
                b = buffers[item.kind]
                value = reader.file(b["file"]).read(b["key"]).reshape(-1)
            else:
                value = scratch[:item.entry.nbytes].view(item.entry.dtype)
                reader.fill(item.param, item.kind, 0, value)
            with open(folder / str(index), "wb") as f:
                f.write(memoryview(value.view(torch.uint8).numpy()))  # type: ignore[arg-type]  # ndarray is a buffer
    finally:
        reader.close()
    return largest


def _mapped(path: Path, entry: Entry) -> torch.Tensor:
    if entry.numel == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    return torch.from_file(str(path), shared=False, size=entry.numel, dtype=entry.dtype).view(entry.shape)


def _state_dict(folder: Path, manifest: dict, items: list[_Item], optimizer: bool) -> dict:
    """The nested state dict dcp.save takes, in get_state_dict's layout."""
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for index, item in enumerate(items):
        value = _mapped(folder / str(index), item.entry)
        if item.param is None:
            model[item.kind] = value
        elif item.kind == "master":
            for alias in item.param["aliases"] or [item.param["fqn"]]:
                model[alias] = value
        else:
            state.setdefault(item.param["fqn"], {})[item.kind.removeprefix("optim.")] = value
    if optimizer and manifest.get("optimizer"):
        for param in (p for p in manifest["params"] if p["state"]):
            group = param["param_group"] if param["param_group"] is not None else 0
            for name, value in manifest["optimizer"]["param_groups"][group]["scalars"].items():
                value = fmt.from_json(value)
                state.setdefault(param["fqn"], {})[name] = (value.detach().clone() if isinstance(value, torch.Tensor)
                                                            else torch.tensor(float(value)))
    return {"model": model, "optim": {"state": state}} if state else {"model": model}


def export_dcp(src: str | os.PathLike, out: str | os.PathLike, *, optimizer: bool = True,
               overwrite: bool = False) -> ExportedDCP:
    """Write the DCP directory ``out`` from the zeroshard checkpoint ``src`` (offline, one process).
    ``optimizer=False`` writes the model only. Atomic: a failure leaves no ``out``."""
    directory = resolve(src)
    manifest = verify(directory)
    out = Path(out)
    refuse_existing(out, overwrite)
    items = _items(manifest, str(directory), optimizer)
    partial = partial_of(out)
    spill = out.parent / f".{out.name}.tensors"
    for stale in (partial, spill):
        if stale.exists():
            shutil.rmtree(stale)
    partial.mkdir(parents=True)
    spill.mkdir()
    try:
        largest = _spill(directory, manifest, items, spill)
        state = _state_dict(spill, manifest, items, optimizer)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.save(state, storage_writer=FileSystemWriter(partial), no_dist=True)
        del state
        commit(partial, out, overwrite=overwrite, latest=False)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    model_keys = sum(len(p["aliases"] or [p["fqn"]]) for p in manifest["params"]) + len(manifest["buffers"])
    optim_keys = sum(1 for i in items if i.param is not None and i.kind != "master")
    size = sum(f.stat().st_size for f in out.iterdir())
    return ExportedDCP(out, model_keys, optim_keys, size, largest)
