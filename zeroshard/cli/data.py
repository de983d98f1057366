"""`zeroshard data prepare TEXT... --tokenizer DIR --out DIR`: tokenize text into token files.

Each TEXT becomes one `NNNNN-<name>.bin` of raw little-endian tokens (uint16 when the vocab
fits, else uint32) plus a `meta.json`; `zeroshard train --data OUT` memory-maps them. A TEXT is a
UTF-8 text file (one document) or a JSONL/JSON/Parquet/Arrow file of records with a `text` column
(one document each); the tokenizer's EOS follows every document, and meta.json records its id, so
`train --doc-mask` can keep attention inside documents. Every input and the tokenizer are checked
before anything is written, and files are written under temporary names and renamed at the end, so
a failure leaves OUT as it was.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from zeroshard.trainer.data_records import is_record_path, load_records
from zeroshard.trainer.data_tokens import FORMAT, META_NAME, dtype_for_vocab

_CHUNK_BYTES = 1 << 20  # text tokenized per batch; split at line ends so words stay whole
Encoder = Callable[[list[str]], list[list[int]]]


class DataError(ValueError):
    """Bad input to `data prepare`; the message names the file and the fix."""


def _eos_of_config(directory: Path, tok: Any) -> int | None:
    """The EOS id a tokenizer.json-only folder's tokenizer_config.json names, if any."""
    path = directory / "tokenizer_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token") if path.is_file() else None
    except ValueError:
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return tok.token_to_id(eos) if isinstance(eos, str) else None


def load_tokenizer(directory: Path) -> tuple[Encoder, int, int | None]:
    """An encoder for batches of strings, the vocab size and the EOS id (None: the tokenizer has
    none), from a local HF tokenizer folder."""
    if not directory.is_dir():
        raise DataError(f"tokenizer folder {str(directory)!r} does not exist or is not a folder")
    if (directory / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # the Rust side raises a bare Exception on a malformed file
            raise DataError(f"tokenizer file {str(directory / 'tokenizer.json')!r} does not load ({e})") from e
        # No special tokens: the text is the data, not a prompt to a chat template.
        return (lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)],
                tok.get_vocab_size(with_added_tokens=True), _eos_of_config(directory, tok))
    if (directory / "tokenizer_config.json").is_file():  # slow (sentencepiece/vocab.txt) tokenizers
        from transformers import AutoTokenizer

        try:
            hf: Any = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as e:  # e.g. a config naming a vocab file that is not there
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"tokenizer folder {str(directory)!r} does not load ({message})") from e
        if len(hf) <= len(set(hf.all_special_ids)):  # transformers builds one from a bare config
            raise DataError(
                f"tokenizer folder {str(directory)!r} has no vocabulary, only special tokens; "
                f"pass a folder saved by tokenizer.save_pretrained(...)"
            )
        return (lambda texts: hf(texts, add_special_tokens=False)["input_ids"], len(hf), hf.eos_token_id)
    raise DataError(
        f"tokenizer folder {str(directory)!r} has no tokenizer.json or tokenizer_config.json; "
        f"pass a folder saved by tokenizer.save_pretrained(...)"
    )


def _chunks(path: Path) -> Iterator[tuple[str, int]]:
    """(text, bytes read) pieces of about ``_CHUNK_BYTES``, ending at a line end."""
    with path.open("r", encoding="utf-8", newline="") as f:
        while True:
            lines = f.readlines(_CHUNK_BYTES)
            if not lines:
                return
            text = "".join(lines)
            yield text, len(text.encode("utf-8"))


def _documents(path: Path, records: Any) -> Iterator[tuple[str, float, bool]]:
    """(text, progress units, ends a document) pieces of one input: a text file's ~1 MiB pieces (one
    document: the last piece ends it), or each record's text, the file's bytes shared out over them."""
    if records is None:
        pieces = list(_chunks(path)) or [("", 0)]
        for i, (text, nbytes) in enumerate(pieces):
            yield text, nbytes, i == len(pieces) - 1
        return
    share = path.stat().st_size / max(1, len(records))
    for text in records["text"]:
        yield str(text), share, True


def _read_records(texts: list[Path]) -> dict[Path, Any]:
    """The record inputs, loaded once: each must have a `text` column (chat data trains as it is)."""
    out = {}
    for p in texts:
        if not is_record_path(p):
            continue
        try:
            records = load_records(p)
        except ValueError as e:
            raise DataError(str(e)) from e
        if "text" not in records.column_names:
            raise DataError(f"{str(p)!r} has columns {records.column_names}, no 'text'; chat and prompt/completion "
                            f"records are trained as they are: pass the file to `zeroshard train --data`")
        out[p] = records
    return out


def _check_inputs(texts: list[Path], records: dict[Path, Any]) -> None:
    for p in texts:
        if p in records:
            continue
        if not p.is_file():
            raise DataError(f"text file {str(p)!r} does not exist or is not a file")
        try:
            with p.open("r", encoding="utf-8") as f:
                while f.read(_CHUNK_BYTES):
                    pass
        except UnicodeDecodeError as e:
            raise DataError(f"text file {str(p)!r} is not UTF-8 ({e.reason} at byte {e.start})") from e


def prepare(texts: list[Path], tokenizer_dir: Path, out: Path, *, show_progress: bool = True) -> dict[str, Any]:
    """Tokenize ``texts`` into ``out``; returns the meta.json written."""
    encode, vocab, eos = load_tokenizer(tokenizer_dir)
    records = _read_records(texts)
    _check_inputs(texts, records)
    dtype_name = dtype_for_vocab(vocab)
    dtype = np.dtype("<u2" if dtype_name == "uint16" else "<u4")
    out.mkdir(parents=True, exist_ok=True)
    names = [f"{i:05d}-{p.stem}.bin" for i, p in enumerate(texts)]
    try:
        counts = _write_tokens(texts, names, records, _Tokens(encode, eos, dtype), out, show_progress)
    except BaseException:
        for name in names:  # leave OUT as it was
            (out / f".{name}.partial").unlink(missing_ok=True)
        raise
    for name in names:
        (out / f".{name}.partial").replace(out / name)
    meta = {"format": FORMAT, "version": 1, "dtype": dtype_name, "vocab_size": vocab,
            "tokenizer": str(tokenizer_dir.resolve()), "eos_id": eos, "files": names, "tokens": counts,
            "sources": [str(p) for p in texts]}
    (out / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


class _Tokens:
    """How a piece of text becomes token bytes: the encoder, the EOS after a document, the dtype."""

    def __init__(self, encode: Encoder, eos: int | None, dtype: np.dtype) -> None:
        self.encode, self.eos, self.dtype = encode, eos, dtype

    def write(self, f: Any, text: str, ends_document: bool) -> int:
        ids = [i for row in self.encode([text]) for i in row] if text else []
        if ends_document and self.eos is not None:  # a window can then tell where a document ends
            ids.append(self.eos)
        np.asarray(ids, dtype=self.dtype).tofile(f)
        return len(ids)


def _write_tokens(texts: list[Path], names: list[str], records: dict[Path, Any], tokens: _Tokens,
                  out: Path, show_progress: bool) -> list[int]:
    """Write each input's tokens to ``.NAME.partial`` under a rich progress bar; token counts."""
    counts: list[int] = []
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    total = sum(p.stat().st_size for p in texts)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not show_progress, transient=False) as bar:
        task = bar.add_task("tokenizing", total=total)
        for p, name in zip(texts, names):
            bar.update(task, description=f"tokenizing {p.name}")
            n = 0
            with (out / f".{name}.partial").open("wb") as f:
                for text, units, ends in _documents(p, records.get(p)):
                    n += tokens.write(f, text, ends)
                    bar.advance(task, units)
            counts.append(n)
    return counts


def cmd_prepare(args: argparse.Namespace) -> int:
    try:
        meta = prepare([Path(t) for t in args.text], Path(args.tokenizer), Path(args.out),
                       show_progress=not args.quiet)
    except DataError as e:
        print(f"zeroshard data prepare: error: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"wrote {sum(meta['tokens']):,} {meta['dtype']} tokens (vocab {meta['vocab_size']:,}) "
          f"in {len(meta['files'])} file(s) to {args.out}; train with --data {args.out}"
          + (" (--doc-mask keeps attention inside documents)" if meta["eos_id"] is not None else
             "; the tokenizer has no eos_token, so documents are not marked"))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("data", help="prepare token datasets",
                       description="Data tools. `data prepare` tokenizes text into token files.")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    prep = data_sub.add_parser(
        "prepare", help="tokenize text files with a local HF tokenizer into a --data folder",
        description="Tokenize TEXT files with the HF tokenizer in a local folder into memory-"
                    "mappable token files (one .bin per TEXT plus meta.json); see docs/data.md.")
    prep.add_argument("text", nargs="+", metavar="TEXT",
                      help="UTF-8 text files (one document each), or JSONL/JSON/Parquet/Arrow files of records "
                           "with a 'text' column (one document per record); an EOS follows every document")
    prep.add_argument("--tokenizer", required=True, metavar="DIR",
                      help="folder with tokenizer.json (or a tokenizer_config.json for AutoTokenizer)")
    prep.add_argument("--out", required=True, metavar="DIR", help="output folder (pass it to train --data)")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(run=cmd_prepare)
