"""Samples of different lengths in rows of ``seq_len``: packed several to a row, or padded one to a row.

Packing keeps the samples apart through the model's own support for packed sequences: each sample's
``position_ids`` restart at 0, and a model reads a new sample wherever a position is not its
predecessor's plus one (transformers' ``find_packed_sequence_indices``; zeroshard's GPT builds a
block-diagonal causal mask from the same rule). Attention then stays inside each sample and every
token's loss is the one it has alone in a row, so packed and padded rows of the same samples give
the same loss. Padding (one sample per row, padded on the right) needs no positions: a causal
model's real tokens never see the pads after them, and the pads carry no loss.

The rows are fixed when the dataset is built, in record order, so row ``i`` is a pure function of
``i`` and the global batch sampler stays resumable and reshardable as it is for token windows.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from zeroshard.trainer.data_records import Sample
from zeroshard.trainer.data_windows import NaturalText, check_index

__all__ = ["IGNORE_INDEX", "RecordDataset", "DocumentWindows", "document_positions",
           "collate_positions"]

IGNORE_INDEX = -100


class RecordDataset(NaturalText):
    """Tokenized records as ``(x, y)`` rows of ``seq_len``; ``y`` is -100 where no loss is taken.

    A sample longer than ``seq_len + 1`` tokens is cut to that length (``truncated`` counts them);
    a sample left with no trained token carries no loss and is dropped (``dropped`` counts them).
    """

    def __init__(self, samples: Sequence[Sample], seq_len: int, *, packing: bool, pad_id: int,
                 vocab_size: int) -> None:
        if seq_len < 1:
            raise ValueError(f"RecordDataset.seq_len must be >= 1, got {seq_len}")
        self.seq_len, self.packing, self.pad_id, self._vocab = seq_len, packing, pad_id, vocab_size
        self.truncated = sum(len(s.ids) > seq_len + 1 for s in samples)
        pairs = [_shifted(s, seq_len) for s in samples]
        self.samples = [p for p in pairs if any(t != IGNORE_INDEX for t in p[1])]
        self.dropped = len(pairs) - len(self.samples)
        if not self.samples:
            raise ValueError("no record has a token to train on (every assistant or completion turn is empty "
                             "or cut off by seq_len); check the data, or raise --seq-len")
        self.rows = _pack([len(x) for x, _ in self.samples], seq_len) if packing else \
            [[i] for i in range(len(self.samples))]

    @property
    def trained_tokens(self) -> int:
        return sum(sum(t != IGNORE_INDEX for t in y) for _, y in self.samples)

    def __len__(self) -> int:
        return len(self.rows)

    def _row(self, i: int) -> list[int]:
        return self.rows[check_index(i, len(self.rows), "rows")]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        y = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.int64)
        at = 0
        for s in self._row(i):
            xs, ys = self.samples[s]
            x[at:at + len(xs)], y[at:at + len(ys)] = torch.tensor(xs), torch.tensor(ys)
            at += len(xs)
        return x, y  # (T,), (T,)

    def positions(self, i: int) -> torch.Tensor | None:
        """Row ``i``'s ``position_ids`` (restarting at each sample, and once more for the pads), or
        None when rows are padded (one sample each: the model's own positions are right)."""
        if not self.packing:
            return None
        out, at = torch.empty(self.seq_len, dtype=torch.int64), 0
        for s in self._row(i):
            n = len(self.samples[s][0])
            out[at:at + n] = torch.arange(n)
            at += n
        out[at:] = torch.arange(self.seq_len - at)
        return out


def _shifted(sample: Sample, seq_len: int) -> tuple[list[int], list[int]]:
    """Inputs and next-token targets of a sample, at most ``seq_len`` long; untrained targets are -100."""
    ids, trained = sample.ids[:seq_len + 1], sample.trained[:seq_len + 1]
    return ids[:-1], [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])]


def _pack(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Samples in order, each into the current row while it fits, else into a new one."""
    rows: list[list[int]] = []
    used = seq_len
    for i, n in enumerate(lengths):
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def document_positions(x: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``position_ids`` of a window ``x`` (T,) that restart after every ``eos_id``: the document an
    EOS ends keeps the EOS, the next one starts at position 0 on the token after it."""
    idx = torch.arange(x.shape[-1])
    starts = torch.zeros_like(x, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = x[..., :-1] == eos_id
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - first


class DocumentWindows:
    """Fixed token windows whose attention stops at document ends (``--doc-mask``): the windows of
    ``windows`` unchanged, with ``position_ids`` restarting after each EOS."""

    def __init__(self, windows: Any, eos_id: int) -> None:
        self.windows, self.eos_id = windows, eos_id

    @property
    def vocab_size(self) -> int:
        return int(self.windows.vocab_size)

    @property
    def entropy_floor(self) -> None:
        return None

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows[i]

    def positions(self, i: int) -> torch.Tensor:
        return document_positions(self.windows[i][0], self.eos_id)


def collate_positions(dataset: Any, indices: Sequence[int]) -> torch.Tensor | None:
    """The ``(B, T)`` position_ids of these rows, or None when the dataset's rows need none."""
    positions = getattr(dataset, "positions", None)
    if not callable(positions):
        return None
    rows = [positions(i) for i in indices]
    return None if any(r is None for r in rows) else torch.stack(rows)


def record_dataset(path: str, tokenizer_dir: str | None, seq_len: int, *, packing: bool) -> RecordDataset:
    """The records of ``path`` tokenized with the tokenizer (and chat template) in ``tokenizer_dir``."""
    from zeroshard.trainer.data_records import load_chat_tokenizer, load_records, tokenize_records

    if tokenizer_dir is None:
        raise ValueError(f"data {path!r} holds records, which need a tokenizer: pass --model DIR (a folder saved "
                         f"with its tokenizer) or --tokenizer DIR")
    tok = load_chat_tokenizer(tokenizer_dir)
    samples = tokenize_records(load_records(path), tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return RecordDataset(samples, seq_len, packing=packing, pad_id=int(pad or 0), vocab_size=len(tok))


def document_windows(windows: Any) -> DocumentWindows:
    """``--doc-mask`` over a token folder: its EOS id comes from the meta.json `data prepare` wrote."""
    eos = getattr(windows, "eos_id", None)
    if eos is None:
        raise ValueError("doc_mask needs a token folder that records its EOS id (meta.json 'eos_id'); write it "
                         "with `zeroshard data prepare`, or drop --doc-mask")
    return DocumentWindows(windows, int(eos))
