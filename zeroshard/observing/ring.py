"""A crash-safe copy of the ledger: a fixed-size ring of records in a memory-mapped file.

A rank that raises dumps its ledger as JSON (``Ledger.dump``). A rank that is killed cannot: the
OOM killer's SIGKILL, and gloo itself, which ``abort()``s a process that receives more bytes than it
posted ("Received data size doesn't match expected size") - exactly the mismatched-shape case the
doctor must explain. Writes into a shared file mapping land in the page cache at once and survive
the process, so the doctor reads this file when a rank left no dump.

Cost: one ``struct.pack_into`` per state change (about a microsecond), no system call. Strings (op,
unit, phase, ...) are interned into a side file that is appended and flushed only when a new string
first appears, which in a training loop is during the first step.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

from zeroshard.comm.ledger import CollectiveRecord, CollectiveState

MAGIC = b"ZSRING01"
_HEADER = struct.Struct("<8siiiiq")  # magic, rank, world, capacity, pid, next_seq
_HEADER_SIZE = 64
# seq, numel, bytes, step, op, dtype, group, unit, phase, uneven, start, end, wait_start, waited, state
_SLOT = struct.Struct("<qqqiiiiiiiddddB7x")
_TAIL = struct.Struct("<dddB")  # end, wait_start, waited, state: what changes after a record is written
_TAIL_OFFSET = _SLOT.size - 7 - _TAIL.size
_NEXT_SEQ = struct.Struct("<q")
_NEXT_SEQ_OFFSET = _HEADER.size - _NEXT_SEQ.size
_STATES = list(CollectiveState)
_STATE_INDEX = {state: i for i, state in enumerate(_STATES)}
_NO_TIME = -1.0


class RingMirror:
    """Mirror of the newest ``capacity`` ledger records in ``path`` (+ ``path.strings``)."""

    def __init__(self, path: str | Path, *, rank: int, world: int, capacity: int = 8192) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        size = _HEADER_SIZE + capacity * _SLOT.size
        with self.path.open("wb") as f:
            f.truncate(size)
        self._file = self.path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), size)
        for i in range(capacity):  # seq = -1 marks an empty slot
            _SLOT.pack_into(self._map, _HEADER_SIZE + i * _SLOT.size, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                            _NO_TIME, _NO_TIME, _NO_TIME, 0.0, 0)
        self._rank, self._world = rank, world
        self._strings: dict[str, int] = {}
        self._strings_file = Path(str(self.path) + ".strings").open("w")
        self._next_seq = 0
        self._write_header()

    def _write_header(self) -> None:
        _HEADER.pack_into(self._map, 0, MAGIC, self._rank, self._world, self.capacity, os.getpid(), self._next_seq)

    def _intern(self, text: str) -> int:
        index = self._strings.get(text)
        if index is None:
            index = len(self._strings)
            self._strings[text] = index
            self._strings_file.write(json.dumps(text) + "\n")
            self._strings_file.flush()  # must be on disk before any slot refers to it
        return index

    def write(self, r: CollectiveRecord) -> None:
        """A new record (training thread): its whole slot, and the header's next seq."""
        if self._map.closed:
            return
        ids = [self._intern(s) for s in (r.op, r.dtype, r.group, r.unit, r.phase)]
        _SLOT.pack_into(self._map, self._offset(r.seq), r.seq, r.numel, r.bytes, r.step, *ids, int(r.uneven),
                        r.start, _time(r.end), _time(r.wait_start), r.waited, _STATE_INDEX[r.state])
        self._next_seq = max(self._next_seq, r.seq + 1)
        _NEXT_SEQ.pack_into(self._map, _NEXT_SEQ_OFFSET, self._next_seq)

    def update(self, r: CollectiveRecord) -> None:
        """A state change, possibly from the backend's completion thread: only the slot's changing
        tail (its strings were interned when it was written; nothing shared is touched)."""
        if self._map.closed or r.seq < self._next_seq - self.capacity:  # closed, or slot reused
            return
        _TAIL.pack_into(self._map, self._offset(r.seq) + _TAIL_OFFSET, _time(r.end), _time(r.wait_start), r.waited,
                        _STATE_INDEX[r.state])

    def _offset(self, seq: int) -> int:
        return _HEADER_SIZE + (seq % self.capacity) * _SLOT.size

    def close(self) -> None:
        self._map.flush()
        self._map.close()
        self._file.close()
        self._strings_file.close()


def _time(value: float | None) -> float:
    return _NO_TIME if value is None else value


def read_ring(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, records) of a ring file, records in seq order, in the same form as a JSON dump."""
    path = Path(path)
    data = path.read_bytes()
    magic, rank, world, capacity, pid, next_seq = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError(f"{path} is not a zeroshard ledger ring (bad magic {magic!r})")
    strings_path = Path(str(path) + ".strings")
    strings = [json.loads(line) for line in strings_path.read_text().splitlines() if line.strip()] \
        if strings_path.exists() else []

    def text(i: int) -> str:
        return strings[i] if 0 <= i < len(strings) else f"<string {i}>"

    records = []
    for i in range(capacity):
        (seq, numel, nbytes, step, op, dtype, group, unit, phase, uneven, start, end, wait_start, waited,
         state) = _SLOT.unpack_from(data, _HEADER_SIZE + i * _SLOT.size)
        if seq < 0:
            continue
        records.append({
            "kind": "collective", "seq": seq, "group": text(group), "op": text(op), "numel": numel,
            "dtype": text(dtype), "bytes": nbytes, "unit": text(unit), "phase": text(phase), "start": start,
            "end": None if end == _NO_TIME else end, "state": _STATES[state].value, "step": step,
            "wait_start": None if wait_start == _NO_TIME else wait_start, "waited": waited,
            **({"uneven": True} if uneven else {}),
        })
    records.sort(key=lambda r: r["seq"])
    header = {"kind": "header", "rank": rank, "world": world, "reason": "ring", "pid": pid,
              "next_seq": next_seq, "capacity": capacity,
              "first_seq": records[0]["seq"] if records else next_seq,
              "in_flight": [r["seq"] for r in records if r["state"] != "completed"]}
    return header, records
