"""Pre-tokenized token files: a folder of raw little-endian uint16/uint32 arrays, memory-mapped.

Layout (see docs/data.md):

  DIR/meta.json   {"format": "zeroshard-tokens", "dtype": "uint16"|"uint32", "vocab_size": N,
                   "files": ["00000-name.bin", ...]}   (written by `zeroshard data prepare`)
  DIR/*.bin       the tokens of each input, back to back, no header (nanoGPT's `.bin` layout)

A folder without meta.json is read the way nanoGPT writes it: uint16 tokens, `train.bin` if
present else every `*.bin` in name order, vocab size = largest token + 1.

Window ``i`` is ``T+1`` consecutive tokens of one file; windows never straddle two files, and
each file's tail shorter than a window is dropped. Sample ``i`` is a pure function of ``i``,
so the existing GlobalBatchSampler stays resumable and reshardable unchanged.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zeroshard.trainer.data_windows import NaturalText, check_index, next_token_pair

__all__ = ["META_NAME", "FORMAT", "TokenFileDataset", "dtype_for_vocab", "is_token_dir"]

META_NAME = "meta.json"
FORMAT = "zeroshard-tokens"
_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest supported dtype that holds every token id below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_token_dir(path: str | Path) -> bool:
    """A folder is read as token files; a file stays byte-level text."""
    return Path(path).is_dir()


def _read_meta(root: Path) -> dict[str, Any] | None:
    meta_path = root / META_NAME
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{meta_path} is not valid JSON ({e}); re-run `zeroshard data prepare`") from e
    if not isinstance(meta, dict) or meta.get("dtype") not in _DTYPES:
        raise ValueError(
            f"{meta_path} must hold a JSON object with \"dtype\" of \"uint16\" or \"uint32\"; "
            f"re-run `zeroshard data prepare`"
        )
    return meta


def _token_files(root: Path, meta: dict[str, Any] | None) -> list[Path]:
    if meta is not None and "files" in meta:
        files = [root / name for name in meta["files"]]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"token file {missing[0]} listed in {root / META_NAME} does not exist")
        return files
    if (root / "train.bin").is_file():  # nanoGPT writes train.bin and val.bin side by side
        return [root / "train.bin"]
    files = sorted(root.glob("*.bin"))
    if not files:
        raise ValueError(
            f"data folder {str(root)!r} has no *.bin token files; make one with "
            f"`zeroshard data prepare TEXT --tokenizer DIR --out {root}`"
        )
    return files


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    size = path.stat().st_size
    if size % dtype.itemsize != 0:
        raise ValueError(
            f"token file {path} has {size} bytes, not a whole number of {dtype.itemsize}-byte "
            f"{dtype.name} tokens; the file is truncated or the dtype in {META_NAME} is wrong"
        )
    if size == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class TokenFileDataset(NaturalText):
    """Non-overlapping ``seq_len + 1`` token windows over memory-mapped token files."""

    def __init__(self, root: str | Path, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"TokenFileDataset.seq_len must be >= 1, got {seq_len}")
        root = Path(root)
        if not root.is_dir():
            raise ValueError(f"data folder {str(root)!r} does not exist or is not a folder")
        meta = _read_meta(root)
        dtype = _DTYPES[meta["dtype"] if meta is not None else "uint16"]
        self.root, self.seq_len, self.files = root, seq_len, _token_files(root, meta)
        self._arrays = [_map(f, dtype) for f in self.files]
        window = seq_len + 1
        counts = [len(a) // window for a in self._arrays]
        self._starts = np.cumsum([0, *counts]).tolist()  # first window index of each file
        if self._starts[-1] == 0:
            raise ValueError(
                f"data folder {str(root)!r} has no file with seq_len + 1 = {window} tokens; "
                f"use more text or a smaller seq_len"
            )
        self._vocab = self._vocab_size(meta)
        self.eos_id: int | None = None if meta is None or meta.get("eos_id") is None else int(meta["eos_id"])
        """The id `data prepare` put after each document (None: not recorded, as in nanoGPT's files)."""

    def _vocab_size(self, meta: dict[str, Any] | None) -> int:
        if meta is not None and "vocab_size" in meta:
            return int(meta["vocab_size"])  # trusted here; each window is checked when read
        # nanoGPT's layout records no vocab: one pass over the files finds the largest id.
        return max((int(a.max()) for a in self._arrays if len(a)), default=0) + 1

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = check_index(i, len(self))
        f = bisect.bisect_right(self._starts, i) - 1
        lo = (i - self._starts[f]) * (self.seq_len + 1)
        # Copy out of the map: int64 for the embedding, and no tensor aliases the file.
        w = torch.from_numpy(self._arrays[f][lo : lo + self.seq_len + 1].astype(np.int64))
        if int(w.max()) >= self._vocab:  # an embedding lookup would fail far less clearly
            raise ValueError(
                f"token file {self.files[f]} holds id {int(w.max())} but {self.root / META_NAME} "
                f"says vocab_size={self._vocab}; re-run `zeroshard data prepare`"
            )
        return next_token_pair(w)  # (T,), (T,)
