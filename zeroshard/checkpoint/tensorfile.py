"""Streaming safetensors files: write one tensor at a time while hashing, read any element range.

We write the safetensors layout ourselves instead of calling ``safetensors.torch.save_file``:

- ``save_file`` takes every tensor at once, as one dict, and moves each accelerator tensor to a
  host copy that it keeps until the file is written. A streaming writer needs only the header up
  front (names, dtypes, shapes), so a consolidated export holds one tensor in memory at a time, not
  the whole model, and a rank's accelerator pieces reach the host one tensor at a time;
- the sha256 is computed from the same buffers as they are written, so hashing costs no extra read
  of a file that may be many GB.

(The library does accept our pieces as they are: safetensors 0.8 saves non-overlapping views of one
flat buffer without a copy; it refuses only tensors whose memory overlaps, such as the same tensor
under two names.)

Reading is also ours: a piece of a param may be needed in part (when resharding), so we read an
element range straight into the destination tensor with ``readinto``; no mmap, whose touched pages
would count against the process's memory. The files are plain safetensors all the same:
``safetensors.torch.load_file`` opens them (the tests check it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from zeroshard.checkpoint.errors import CheckpointError

_TO_NAME = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in _TO_NAME.items()}
_HEADER_LIMIT = 100 * 2**20  # what the safetensors library itself accepts
_CHUNK = 2**20  # small: hashing speed does not improve with bigger reads, memory does grow


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's spelling of a dtype ("float32"), also accepted by :func:`parse_dtype`."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype not in _TO_NAME:
        raise CheckpointError(f"{where}: unsupported dtype {name!r}")
    return dtype


class Sized:
    """Element and byte counts of anything with a ``shape`` and a ``dtype``."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Entry(Sized):
    """One tensor of a file: its name, dtype and shape (known before any data is written)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, flattened (an accelerator tensor is copied to the host first)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer


class TensorFileWriter:
    """Write ``entries`` in order to ``path``; the header is written first, so the entries are fixed."""

    def __init__(self, path: Path, entries: list[Entry], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.entries = entries
        header: dict[str, object] = {}
        offset = 0
        for entry in entries:
            if entry.name in header or entry.name == "__metadata__":
                raise CheckpointError(f"{self.path.name}: tensor name {entry.name!r} is used twice")
            header[entry.name] = {"dtype": _TO_NAME[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [offset, offset + entry.nbytes]}
            offset += entry.nbytes
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the reference writer aligns the data to 8 bytes
        self._hash = hashlib.sha256()
        # Hashing and writing both release the GIL, so the digest of a tensor is computed on a
        # helper thread while the same bytes are written: a save costs max(write, hash), not the sum.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zs-sha256")
        self._hashing: Future | None = None
        self._next = 0
        self._file = open(self.path, "wb")
        self.bytes = 0
        self._put(struct.pack("<Q", len(raw)))
        self._put(raw)

    def _put(self, data) -> None:
        if self._hashing is not None:
            self._hashing.result()  # one tensor in flight: bounded memory, digest order preserved
        self._hashing = self._hasher.submit(self._hash.update, data)
        self._file.write(data)
        self.bytes += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next entry's values (any shape with the entry's numel and exactly its dtype)."""
        entry = self.entries[self._next]
        if name != entry.name or tensor.dtype != entry.dtype or tensor.numel() != entry.numel:
            raise CheckpointError(
                f"{self.path.name}: expected {entry.name} ({dtype_name(entry.dtype)}, {entry.numel} elements) "
                f"next, got {name} ({dtype_name(tensor.dtype)}, {tensor.numel()} elements)")
        if entry.nbytes:
            self._put(as_bytes(tensor))
        self._next += 1

    def close(self) -> tuple[str, int]:
        """Flush and fsync; returns (sha256 hex, size in bytes)."""
        if self._next != len(self.entries):
            raise CheckpointError(f"{self.path.name}: closed after {self._next} of {len(self.entries)} tensors")
        self._hasher.shutdown(wait=True)
        if self._hashing is not None:
            self._hashing.result()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._hash.hexdigest(), self.bytes

    def flush(self) -> None:
        """Push what was written so far to the OS (the fault-injection test kills the process next)."""
        self._file.flush()

    def abort(self) -> None:
        self._hasher.shutdown(wait=True)
        self._file.close()


@dataclasses.dataclass(frozen=True)
class Stored:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        return (self.end - self.begin) // self.dtype.itemsize


class TensorFile:
    """A safetensors file opened for ranged reads; ``label`` is how errors name it."""

    def __init__(self, path: Path, label: str | None = None) -> None:
        self.path = Path(path)
        self.label = label or str(self.path)
        try:
            self._file = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {self.label} is missing") from None
        size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(8)
        if len(head) < 8:
            raise CheckpointError(f"checkpoint file {self.label} is truncated ({size} bytes, no header)")
        (length,) = struct.unpack("<Q", head)
        if length > _HEADER_LIMIT or 8 + length > size:
            raise CheckpointError(f"checkpoint file {self.label} is truncated or not safetensors "
                                  f"(header of {length} bytes, file of {size})")
        try:
            header = json.loads(self._file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint file {self.label} has a corrupt header: {e}") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        base = 8 + length
        self.tensors: dict[str, Stored] = {}
        for name, info in header.items():
            try:
                dtype = _FROM_NAME[info["dtype"]]
                begin, end = (base + int(x) for x in info["data_offsets"])
                shape = tuple(int(d) for d in info["shape"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"checkpoint file {self.label}: malformed header entry {name!r}") from None
            stored = Stored(dtype, shape, begin, end)
            n = 1
            for d in shape:
                n *= d
            if end > size or end - begin != n * dtype.itemsize:
                raise CheckpointError(f"checkpoint file {self.label} is truncated or corrupt: tensor {name!r} "
                                      f"needs bytes [{begin}, {end}) of {size}")
            self.tensors[name] = stored

    def file_descriptor(self) -> int:
        """The open file, for callers that read raw byte ranges (repair hashes each tensor's bytes)."""
        return self._file.fileno()

    def stored(self, name: str) -> Stored:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"checkpoint file {self.label} has no tensor {name!r}") from None

    def read_into(self, name: str, first: int, out: torch.Tensor) -> None:
        """Read elements ``[first, first + out.numel())`` of flattened tensor ``name`` into ``out``."""
        info = self.stored(name)
        if out.dtype != info.dtype:
            raise CheckpointError(f"checkpoint file {self.label}: {name} is {dtype_name(info.dtype)}, "
                                  f"the destination is {dtype_name(out.dtype)}")
        count = out.numel()
        if first < 0 or first + count > info.numel:
            raise CheckpointError(f"checkpoint file {self.label}: elements [{first}, {first + count}) "
                                  f"are outside {name} ({info.numel} elements)")
        if count == 0:
            return
        target = out if out.device.type == "cpu" and out.is_contiguous() else torch.empty(count, dtype=out.dtype)
        view = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer
        offset = info.begin + first * info.dtype.itemsize
        done = 0
        while done < len(view):
            got = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"checkpoint file {self.label} ended while reading {name}")
            done += got
        if target is not out:
            with torch.no_grad():
                out.copy_(target.view(out.shape))

    def read(self, name: str) -> torch.Tensor:
        info = self.stored(name)
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(name, 0, out)
        return out

    def close(self) -> None:
        self._file.close()


def file_sha256(path: Path) -> tuple[str, int]:
    """(sha256 hex, bytes) of a file, read in fixed chunks so memory stays constant.

    Two buffers alternate: the helper thread hashes one chunk while the next is read into the
    other, so verification costs max(read, hash) rather than their sum.
    """
    digest = hashlib.sha256()
    buffers = [bytearray(_CHUNK), bytearray(_CHUNK)]
    size, turn, pending = 0, 0, None
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(max_workers=1) as hasher:
        while True:
            n = f.readinto(buffers[turn])
            if pending is not None:
                pending.result()
            if not n:
                break
            pending = hasher.submit(digest.update, memoryview(buffers[turn])[:n])
            size += n
            turn ^= 1
    return digest.hexdigest(), size
