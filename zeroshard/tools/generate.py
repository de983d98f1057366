"""Text generation from a zeroshard checkpoint or a ``save_pretrained`` folder.

A checkpoint is read in place: the model is rebuilt from the config its manifest records
(zeroshard's GPT or a Hugging Face causal LM) and each param is filled straight from the rank
files by ``zeroshard.checkpoint.load`` (the unsharded path reads one param at a time), so no
consolidated copy is ever written. A folder is opened with ``AutoModelForCausalLM.from_pretrained``.

Decoding is a plain loop over full forward passes (no KV cache): small models and short prompts
are what this tool is for, and one loop serves both model families. Greedy is the argmax of the
last position; sampling divides the logits by the temperature, keeps the top k and draws with a
``torch.Generator`` seeded by ``seed``, so a sampled output is reproducible.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["GenerateError", "Generator", "decode", "encode", "generate", "open_model"]


class GenerateError(ValueError):
    """Bad input to ``zeroshard generate``: the message names the problem and the fix."""


@dataclasses.dataclass
class Generator:
    """A model ready to decode, with what turns text into ids (``tokenizer`` is None for byte-level runs)."""

    model: nn.Module
    tokenizer: Any
    source: str
    eos_token_id: int | None
    max_len: int | None


def _tokenizer(folder: str | None) -> Any:
    """The tokenizer saved in ``folder``, or None when it has none (a synthetic or byte-level run)."""
    if not folder or not (Path(folder) / "tokenizer.json").is_file() and not (
            Path(folder) / "tokenizer.model").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _eos(config: Any, model: nn.Module) -> int | None:
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    eos = getattr(config, "eos_token_id", None) if eos is None else eos
    return eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None


def _open_folder(folder: Path) -> Generator:
    from zeroshard.models.hf import require_transformers

    tf = require_transformers()
    model = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    config = model.config
    return Generator(model, _tokenizer(str(folder)), str(folder), _eos(config, model),
                     getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None))


def _build_from_record(record: dict, where: str) -> tuple[nn.Module, str | None]:
    """The plain model the manifest's ``model`` record describes, on CPU (values about to be loaded)."""
    from zeroshard.checkpoint import format as fmt

    config = fmt.from_json(record.get("config"))
    if isinstance(config, dict) and "hf_config" in config:
        from zeroshard.models.hf import require_transformers

        tf = require_transformers()
        hf = dict(config["hf_config"])
        hf_config = tf.AutoConfig.for_model(hf.pop("model_type"), **hf)
        return tf.AutoModelForCausalLM.from_config(hf_config), config.get("source") or None
    if str(record.get("class", "")).endswith(".GPT") and isinstance(config, dict):
        from zeroshard.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig.from_dict(config)), None
    raise GenerateError(f"{where} records model {record.get('class')!r}, which generate cannot rebuild; "
                        "export it with `zeroshard ckpt export --hf` and generate from that folder")


def _open_checkpoint(path: str | Path) -> Generator:
    from zeroshard.checkpoint import load, resolve
    from zeroshard.checkpoint.format import read_manifest

    directory = resolve(path)
    model, source = _build_from_record(read_manifest(directory).get("model") or {}, str(directory))
    load(directory, model, rng=False)  # unsharded: one param at a time from the rank files
    model.eval()
    config = getattr(model, "config", None)
    if config is not None:  # a Hugging Face model
        return Generator(model, _tokenizer(source), str(directory), _eos(config, model),
                         getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None))
    return Generator(model, None, str(directory), None, int(getattr(model, "cfg").seq_len))


def open_model(path: str | Path) -> Generator:
    """A ``save_pretrained`` folder or a zeroshard checkpoint (directory or root with ``latest``)."""
    from zeroshard.checkpoint.hf.folder import is_pretrained_folder

    p = Path(path)
    if not p.exists():
        raise GenerateError(f"{p} does not exist; give a checkpoint directory (or its root) or a "
                            "save_pretrained folder")
    return _open_folder(p) if is_pretrained_folder(p) else _open_checkpoint(p)


def encode(gen: Generator, prompt: str | None, ids: list[int] | None) -> list[int]:
    """Prompt ids: given directly, through the tokenizer, or the prompt's UTF-8 bytes (byte-level vocab)."""
    if ids is not None and prompt is not None:
        raise GenerateError("give either --prompt or --prompt-ids, not both")
    if ids is not None:
        return ids
    if prompt is None:
        raise GenerateError("give a prompt: --prompt TEXT or --prompt-ids 1,2,3")
    if gen.tokenizer is not None:
        return list(gen.tokenizer(prompt)["input_ids"])
    vocab = _vocab(gen.model)
    if vocab < 256:
        raise GenerateError(f"{gen.source} has no tokenizer and a vocab of {vocab} (< 256, so not bytes); "
                            "pass token ids with --prompt-ids 1,2,3")
    return list(prompt.encode("utf-8"))


def decode(gen: Generator, ids: list[int]) -> str | None:
    """Text for ``ids``, or None when there is no tokenizer and the vocab is not bytes."""
    if gen.tokenizer is not None:
        return str(gen.tokenizer.decode(ids))
    if _vocab(gen.model) >= 256 and all(i < 256 for i in ids):
        return bytes(ids).decode("utf-8", errors="replace")
    return None


def _vocab(model: nn.Module) -> int:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else getattr(model, "tok_emb")
    return int(emb.weight.shape[0])


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "config"):
        return model(input_ids=ids).logits[0, -1]
    return model(ids)[0, -1]


def _next(logits: torch.Tensor, temperature: float, top_k: int | None, rng: torch.Generator) -> int:
    if temperature == 0 and top_k is None:
        return int(torch.argmax(logits))
    logits = logits.float() / (temperature or 1.0)
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=rng))


@torch.no_grad()
def generate(gen: Generator, ids: list[int], *, max_new_tokens: int = 32, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0) -> list[int]:
    """The new token ids after ``ids``: greedy when ``temperature == 0`` and no ``top_k``; stops at EOS."""
    if not ids:
        raise GenerateError("the prompt encodes to no tokens; give a longer --prompt or --prompt-ids")
    if temperature < 0:
        raise GenerateError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise GenerateError(f"--top-k must be >= 1, got {top_k}")
    vocab = _vocab(gen.model)
    if max(ids) >= vocab or min(ids) < 0:
        raise GenerateError(f"prompt ids must lie in [0, {vocab}) for {gen.source}; got {min(ids)}..{max(ids)}")
    if gen.max_len is not None and len(ids) + max_new_tokens > gen.max_len:
        raise GenerateError(f"prompt ({len(ids)}) + --max-new-tokens ({max_new_tokens}) exceeds the model's "
                            f"{gen.max_len} positions; shorten one of them")
    rng = torch.Generator().manual_seed(seed)
    seq = torch.tensor([ids], dtype=torch.long)
    new: list[int] = []
    for _ in range(max_new_tokens):
        token = _next(_logits(gen.model, seq), temperature, top_k, rng)
        new.append(token)
        if token == gen.eos_token_id:
            break
        seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    return new
