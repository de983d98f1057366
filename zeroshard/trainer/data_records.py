"""Record files (JSONL, JSON, Parquet, Arrow) as training samples: plain text, chat, prompt/completion.

Each record becomes one sample: its token ids and, per token, whether the loss covers it.

- ``text``: every token is trained; an EOS closes the document.
- ``messages`` (a list of ``{"role", "content"}``, system turns and several exchanges allowed): the
  conversation is rendered with the tokenizer's own chat template, and only the assistant turns are
  trained (each with whatever the template closes a turn with, so the model learns to stop).
- ``prompt`` and ``completion``: strings (the completion is trained, then an EOS), or lists of
  messages as TRL writes them (the prompt rendered with the generation prompt, the completion's
  turns trained).

Where an assistant turn lies is found from the template itself, so any template works: the
conversation is rendered prefix by prefix (up to turn k with the generation prompt, then through
turn k), and the characters between the two renderings are turn k's. Tokens are mapped to
characters through the fast tokenizer's offsets. A template that marks its turns with
``{% generation %}`` is asked for its own assistant mask instead.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

__all__ = ["RECORD_SUFFIXES", "Sample", "is_record_path", "load_records", "load_chat_tokenizer", "tokenize_records"]

RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""File suffix -> the `datasets` builder that reads it."""

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class Sample:
    """One record's tokens and which of them the loss covers (``trained[t]`` for token ``t``)."""

    ids: list[int]
    trained: list[bool]


def _record_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in RECORD_SUFFIXES)
    return [path] if path.suffix in RECORD_SUFFIXES else []


def is_record_path(path: str | Path) -> bool:
    """A JSONL/JSON/Parquet/Arrow file, a folder of them, or a folder `Dataset.save_to_disk` wrote."""
    path = Path(path)
    if path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
        return True
    return bool(_record_files(path)) and not (path.is_dir() and any(path.glob("*.bin")))


def load_records(path: str | Path) -> Any:
    """The records of ``path`` as a `datasets.Dataset`, in file order (read in memory: no cache is left)."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise ValueError(f"data {str(path)!r} does not exist; pass a .jsonl, .json, .parquet or .arrow file")
    datasets.disable_progress_bars()
    if path.is_dir() and (path / "state.json").is_file():
        return datasets.load_from_disk(str(path), keep_in_memory=True)
    files = _record_files(path)
    builders = {RECORD_SUFFIXES[f.suffix] for f in files}
    if len(builders) != 1:
        raise ValueError(f"data folder {str(path)!r} mixes {sorted(builders)} files; keep one format per folder")
    with tempfile.TemporaryDirectory(prefix="zeroshard-records-") as cache:
        try:
            return datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files], split="train",
                                         cache_dir=cache, keep_in_memory=True)
        except Exception as e:  # datasets wraps the parser's error in several layers; one line is enough
            cause = e.__cause__ or e
            raise ValueError(f"data {str(path)!r} does not read as {files[0].suffix} records "
                             f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})") from e


def load_chat_tokenizer(directory: str | Path) -> Any:
    """The fast tokenizer of a model folder (its chat template included)."""
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
        raise ValueError(f"{str(directory)!r} has no tokenizer (tokenizer.json or tokenizer_config.json); record "
                         f"data needs one: pass a model folder saved with its tokenizer, or --tokenizer DIR")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"the tokenizer in {str(directory)!r} is not a fast tokenizer (no tokenizer.json); "
                         f"save it with tokenizer.save_pretrained from a fast tokenizer")
    return tok


def record_shape(columns: Iterable[str]) -> str:
    """``text``, ``chat`` or ``prompt-completion``, from a dataset's columns."""
    columns = set(columns)
    if "messages" in columns:
        return "chat"
    if {"prompt", "completion"} <= columns:
        return "prompt-completion"
    if "text" in columns:
        return "text"
    raise ValueError(f"records have columns {sorted(columns)}; expected 'text', 'messages' (chat) or "
                     f"'prompt' and 'completion'")


def tokenize_records(records: Any, tok: Any) -> list[Sample]:
    """Every record of ``records`` as a `Sample`, in order."""
    shape = record_shape(records.column_names)
    if shape in ("chat", "prompt-completion") and not getattr(tok, "chat_template", None):
        sample = records[0]
        if shape == "chat" or not isinstance(sample["prompt"], str):
            raise ValueError("chat records need a tokenizer with a chat template, and this one has none; set "
                             "tokenizer.chat_template and save_pretrained it into the model folder")
    out = []
    for index, record in enumerate(records):
        try:
            out.append(_sample(shape, record, tok))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"record {index}: {e}") from e
    return out


def _sample(shape: str, record: dict[str, Any], tok: Any) -> Sample:
    if shape == "text":
        return _spans(tok, str(record["text"]) + _eos(tok), [(0, None)])
    if shape == "chat":
        return _chat(tok, _messages(record["messages"]), 0)
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return _spans(tok, prompt + completion + _eos(tok), [(len(prompt), None)])
    prompt, completion = _messages(prompt), _messages(completion)
    return _chat(tok, prompt + completion, len(prompt))


def _eos(tok: Any) -> str:
    if tok.eos_token is None:
        raise ValueError("the tokenizer has no eos_token to end a document with; set tokenizer.eos_token")
    return str(tok.eos_token)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...}")
    return [{"role": str(m["role"]), "content": m["content"]} for m in value]


def _render(tok: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _chat(tok: Any, messages: list[dict[str, str]], first: int) -> Sample:
    """``messages`` rendered whole; the assistant turns from index ``first`` on are trained."""
    if _GENERATION_TAG.search(str(tok.chat_template)):
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        if first:  # the prompt's own assistant turns (a TRL prompt may hold some) stay untrained
            start = len(tok.apply_chat_template(messages[:first], tokenize=True, add_generation_prompt=True))
            mask = [0] * start + mask[start:]
        return Sample(ids, [bool(m) for m in mask])
    text = _render(tok, messages, False)
    spans: list[tuple[int, int | None]] = []
    for k, message in enumerate(messages):
        if k < first or message["role"] != "assistant":
            continue
        before, through = _render(tok, messages[:k], True), _render(tok, messages[:k + 1], False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError("the chat template does not render a conversation as the sum of its turns, so "
                             "the assistant tokens cannot be found; use a template with {% generation %} tags")
        spans.append((len(before), len(through)))
    return _spans(tok, text, spans)


def _spans(tok: Any, text: str, spans: list[tuple[int, int | None]]) -> Sample:
    """``text`` tokenized (the template's or our own specials are in it already); a token is trained
    when it starts inside one of the character ``spans`` (``None`` ends at the text's end)."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    bounds = [(lo, len(text) if hi is None else hi) for lo, hi in spans]
    trained = [any(lo <= start < hi for lo, hi in bounds) for start, _ in offsets]
    return Sample(ids, trained)
