"""`zeroshard data prepare TEXT... --tokenizer DIR --out DIR`: tokenize text into token files.

Each TEXT becomes one `NNNNN-<name>.bin` of raw little-endian tokens (uint16 when the vocab
fits, else uint32) plus a `meta.json`; `zeroshard train --data OUT` memory-maps them. Every
input and the tokenizer are checked before anything is written, and files are written under
temporary names and renamed at the end, so a failure leaves OUT as it was.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from zeroshard.trainer.data_tokens import FORMAT, META_NAME, dtype_for_vocab

_CHUNK_BYTES = 1 << 20  # text tokenized per batch; split at line ends so words stay whole
Encoder = Callable[[list[str]], list[list[int]]]


class DataError(ValueError):
    """Bad input to `data prepare`; the message names the file and the fix."""


def load_tokenizer(directory: Path) -> tuple[Encoder, int]:
    """An encoder for batches of strings and the vocab size, from a local HF tokenizer folder."""
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
                tok.get_vocab_size(with_added_tokens=True))
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
        return (lambda texts: hf(texts, add_special_tokens=False)["input_ids"], len(hf))
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


def _check_inputs(texts: list[Path]) -> None:
    for p in texts:
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
    encode, vocab = load_tokenizer(tokenizer_dir)
    _check_inputs(texts)
    dtype_name = dtype_for_vocab(vocab)
    dtype = np.dtype("<u2" if dtype_name == "uint16" else "<u4")
    out.mkdir(parents=True, exist_ok=True)
    names = [f"{i:05d}-{p.stem}.bin" for i, p in enumerate(texts)]
    try:
        counts = _write_tokens(texts, names, encode, dtype, out, show_progress)
    except BaseException:
        for name in names:  # leave OUT as it was
            (out / f".{name}.partial").unlink(missing_ok=True)
        raise
    for name in names:
        (out / f".{name}.partial").replace(out / name)
    meta = {"format": FORMAT, "version": 1, "dtype": dtype_name, "vocab_size": vocab,
            "tokenizer": str(tokenizer_dir.resolve()), "files": names, "tokens": counts,
            "sources": [str(p) for p in texts]}
    (out / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _write_tokens(texts: list[Path], names: list[str], encode: Encoder, dtype: np.dtype,
                  out: Path, show_progress: bool) -> list[int]:
    """Write each text's tokens to ``.NAME.partial`` under a rich progress bar; token counts."""
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
                for text, nbytes in _chunks(p):
                    ids = [i for row in encode([text]) for i in row]
                    np.asarray(ids, dtype=dtype).tofile(f)
                    n += len(ids)
                    bar.advance(task, nbytes)
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
          f"in {len(meta['files'])} file(s) to {args.out}; train with --data {args.out}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("data", help="prepare token datasets",
                       description="Data tools. `data prepare` tokenizes text into token files.")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    prep = data_sub.add_parser(
        "prepare", help="tokenize text files with a local HF tokenizer into a --data folder",
        description="Tokenize TEXT files with the HF tokenizer in a local folder into memory-"
                    "mappable token files (one .bin per TEXT plus meta.json); see docs/data.md.")
    prep.add_argument("text", nargs="+", metavar="TEXT", help="UTF-8 text files")
    prep.add_argument("--tokenizer", required=True, metavar="DIR",
                      help="folder with tokenizer.json (or a tokenizer_config.json for AutoTokenizer)")
    prep.add_argument("--out", required=True, metavar="DIR", help="output folder (pass it to train --data)")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(run=cmd_prepare)
