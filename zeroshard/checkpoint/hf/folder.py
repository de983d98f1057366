"""Reading a ``save_pretrained`` folder's safetensors files by element range.

A folder holds either one ``model.safetensors`` or several shard files listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> file). Files are opened with
``safetensors.safe_open``, which maps them and parses only the header, so asking for a slice reads
just the rows that hold it: a rank reading its 1/N shard touches about 1/N of the bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.hf.errors import PretrainedError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"


def is_pretrained_folder(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file()


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / INDEX
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise PretrainedError(f"{index}: not a safetensors index ({e}); rewrite it with save_pretrained") from e
    if (folder / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE), framework="pt") as f:
            return {name: SINGLE for name in f.keys()}
    raise PretrainedError(f"{folder} has neither {INDEX} nor {SINGLE}; point at a folder written by save_pretrained")


class FolderReader:
    """Tensor names, shapes and element ranges of a pretrained folder; files opened lazily, once."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.weight_map = _weight_map(self.folder)
        missing = sorted({f for f in self.weight_map.values() if not (self.folder / f).is_file()})
        if missing:
            raise PretrainedError(f"{self.folder / missing[0]} is missing (listed in {INDEX}); "
                                  "copy the complete folder")
        self._open: dict[str, Any] = {}
        self.bytes_read = 0  # what the slices asked of the files: whole rows, so a bit over the range

    def _file(self, name: str) -> Any:
        file = self.weight_map[name]
        if file not in self._open:
            from safetensors import safe_open

            try:
                self._open[file] = safe_open(str(self.folder / file), framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise PretrainedError(f"{self.folder / file}: not a readable safetensors file ({e})") from e
        handle = self._open[file]
        if name not in handle.keys():
            raise PretrainedError(f"{self.folder / file} has no tensor {name!r} although {INDEX} lists it there")
        return handle

    def where(self, name: str) -> str:
        return str(self.folder / self.weight_map[name])

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self._file(name).get_slice(name).get_shape())

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor, in the file's dtype.

        safetensors slices along dimensions, so we read the whole rows (of dim 0) that hold the
        range and cut it out: at most two partial rows more than asked for.
        """
        part = self._file(name).get_slice(name)
        shape = part.get_shape()
        if len(shape) == 0:
            return self._file(name).get_tensor(name).reshape(-1)[start:stop]
        row = 1
        for d in shape[1:]:
            row *= d
        if row == 0:
            return torch.empty(0)
        first, last = start // row, -(-stop // row)
        rows = part[first:last].reshape(-1)
        self.bytes_read += rows.numel() * rows.element_size()
        return rows[start - first * row:stop - first * row]

    def read(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def close(self) -> None:
        self._open.clear()  # safe_open handles unmap when dropped
