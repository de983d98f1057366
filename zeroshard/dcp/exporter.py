"""``zeroshard ckpt export-dcp``: a zeroshard checkpoint -> a DCP directory that FSDP2 loads with
``dcp.load``, in the ``get_state_dict`` conventions: ``model.<fqn>`` for every param (under each of
its names, as a tied weight has in FSDP2) and persistent buffer, and ``optim.state.<fqn>.<name>``
for the optimizer state (elementwise tensors, and each param's scalar ``step`` as a 0-dim tensor).
Optimizer param-group options are not written: the FSDP2 optimizer brings its own.

``dcp.save`` takes the whole state dict at once. To keep it from holding the model in memory, the
checkpoint's pieces are first streamed (one param at a time) into one consolidated safetensors file
next to OUT, and the state dict handed to ``dcp.save(no_dist=True)`` is made of views of that file
mapped into memory: their pages are file-backed and come and go with the page cache, and DCP copies
one tensor at a time as it writes. The cost is disk: the temporary file is the size of the export.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from pathlib import Path
from typing import cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.load import PieceReader
from zeroshard.checkpoint.save import commit
from zeroshard.checkpoint.tensorfile import Entry, TensorFile, TensorFileWriter, parse_dtype
from zeroshard.checkpoint.verify import resolve, verify


@dataclasses.dataclass
class ExportedDCP:
    path: Path
    model_keys: int
    optimizer_keys: int
    bytes: int
    largest_param_bytes: int


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _entries(manifest: dict, where: str, optimizer: bool) -> list[tuple[Entry, dict | None, str]]:
    """(entry, param or None for a buffer, piece kind) for everything the export writes, widest dtype
    first so that every tensor of the consolidated file starts aligned to its element size."""
    out: list[tuple[Entry, dict | None, str]] = []
    for param in manifest["params"]:
        shape = tuple(param["shape"])
        out.append((Entry(f"model/{param['fqn']}", parse_dtype(param["dtype"], where), shape), param, "master"))
        for name in param["state"] if optimizer else []:
            out.append((Entry(f"optim/{param['fqn']}/{name}", _state_dtype(manifest, where, param, name), shape),
                        param, f"optim.{name}"))
    for buffer in manifest["buffers"]:
        out.append((Entry(f"buffer/{buffer['name']}", parse_dtype(buffer["dtype"], where), tuple(buffer["shape"])),
                    None, buffer["name"]))
    return sorted(out, key=lambda e: -e[0].dtype.itemsize)


def _state_dtype(manifest: dict, where: str, param: dict, name: str) -> torch.dtype:
    if not param["pieces"]:
        return parse_dtype(param["dtype"], where)
    piece = param["pieces"][0]
    opened = TensorFile(Path(where) / piece["file"])
    try:
        return opened.stored(fmt.piece_key(f"optim.{name}", param["fqn"], piece["start"], piece["stop"])).dtype
    finally:
        opened.close()


def _consolidate(directory: Path, manifest: dict, entries: list, path: Path) -> int:
    """Stream every param (and its state) whole into one safetensors file; returns the largest param's bytes."""
    largest = max((e.nbytes for e, p, _ in entries if p is not None), default=0)
    scratch = [torch.empty(largest, dtype=torch.uint8) for _ in range(2)]  # the writer hashes one while we read
    reader = PieceReader(directory, manifest)
    writer = TensorFileWriter(path, [e for e, _, _ in entries])
    try:
        for turn, (entry, param, kind) in enumerate(entries):
            if param is None:
                buffer = next(b for b in manifest["buffers"] if b["name"] == kind)
                writer.write(entry.name, reader.file(buffer["file"]).read(buffer["key"]))
                continue
            value = scratch[turn % 2][:entry.nbytes].view(entry.dtype)
            reader.fill(param, kind, 0, value)
            writer.write(entry.name, value)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()
    return largest


def _mapped_state(path: Path, manifest: dict, entries: list, optimizer: bool) -> dict:
    """The nested state dict dcp.save takes, every tensor a view of the mapped consolidated file."""
    opened = TensorFile(path)  # only its header: where each tensor lies in the file
    opened.close()
    storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(str(path), False, path.stat().st_size))
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for entry, param, _ in entries:
        stored = opened.stored(entry.name)
        value = whole[stored.begin:stored.end].view(entry.dtype).view(entry.shape)
        kind, _, rest = entry.name.partition("/")
        if kind == "optim":
            fqn, _, name = rest.rpartition("/")
            state.setdefault(fqn, {})[name] = value
        elif kind == "model" and param is not None:
            for alias in param["aliases"] or [param["fqn"]]:
                model[alias] = value
        else:
            model[rest] = value
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
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; choose another output path or pass --overwrite")
    entries = _entries(manifest, str(directory), optimizer)
    partial = out.parent / f".{out.name}.partial"
    flat = out.parent / f".{out.name}.consolidated.safetensors"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        largest = _consolidate(directory, manifest, entries, flat)
        state = _mapped_state(flat, manifest, entries, optimizer)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.save(state, storage_writer=FileSystemWriter(partial), no_dist=True)
        del state
        commit(partial, out, overwrite=overwrite, latest=False)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        flat.unlink(missing_ok=True)
    model_keys = sum(len(p["aliases"] or [p["fqn"]]) for p in manifest["params"]) + len(manifest["buffers"])
    optim_keys = sum(1 for e, _, _ in entries if e.name.startswith("optim/"))
    size = sum(f.stat().st_size for f in out.iterdir())
    return ExportedDCP(out, model_keys, optim_keys, size, largest)
