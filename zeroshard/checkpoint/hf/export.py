"""Write a ``from_pretrained`` folder: from a live sharded model or from a zeroshard checkpoint.

The folder is what ``save_pretrained`` writes: ``config.json`` (+ ``generation_config.json`` and
tokenizer files copied from the folder the run started from), ``model-0000K-of-0000N.safetensors``
of at most ``max_shard_size`` bytes each, and ``model.safetensors.index.json``. Each param is
written once, under its first name (a tied LM head is stored as the embedding, as transformers
does), in the naming ``save_pretrained`` uses: a name transformers renames on load (GPT-NeoX's
``lm_head``, stored as ``embed_out``) is written as the files have it (zeroshard/checkpoint/hf/renames.py).
Tensors are streamed one at a time through the checkpoint writer, and the folder is built
under a temporary name next to ``out`` and renamed at the end, so a failure leaves no ``out``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from zeroshard.checkpoint.tensorfile import Entry, TensorFileWriter
from zeroshard.checkpoint.hf.adapter import adapter_tensors, base_name, merged_value, write_adapter_folder
from zeroshard.checkpoint.hf.errors import PretrainedError
from zeroshard.checkpoint.hf.folder import CONFIG, INDEX
from zeroshard.checkpoint.hf.renames import saved_tensors, saved_tensors_of_config
from zeroshard.checkpoint.staging import fresh_partial, refuse_existing

__all__ = ["export_checkpoint", "export_pretrained", "parse_size"]

# What save_pretrained / tokenizer.save_pretrained leave in a folder besides the weights.
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"64KiB"`` or a byte count, as save_pretrained's max_shard_size."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if s.endswith(unit) and s[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(s[:-len(unit)]) * _UNITS[unit])
    if s.isdigit():
        return int(s)
    raise PretrainedError(f"max shard size {text!r} is not a size; write e.g. 5GB, 500MB or 64KiB")


def _split(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """Consecutive entries into files of at most ``limit`` bytes (a bigger tensor gets its own)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


class FolderWriter:
    """Streams tensors, in the order of ``entries``, into a temporary folder renamed to ``out``."""

    def __init__(self, out: str | Path, config: dict[str, Any], source: str | None, entries: list[Entry],
                 max_shard_size: int, overwrite: bool = False) -> None:
        self.out = Path(out)
        refuse_existing(self.out, overwrite, error=PretrainedError, choose="output folder")
        self.tmp = fresh_partial(self.out)
        self.files = _split(entries, max_shard_size)
        n = len(self.files)
        self.names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)] if n > 1 else ["model.safetensors"]
        self._file, self._left = -1, 0
        self._writer: TensorFileWriter | None = None
        config = dict(config)
        if entries:
            config["dtype"] = str(entries[0].dtype).removeprefix("torch.")
        (self.tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for side in SIDE_FILES if source else ():
            if (Path(source) / side).is_file():  # type: ignore[arg-type]
                shutil.copyfile(Path(source) / side, self.tmp / side)  # type: ignore[arg-type]

    def write(self, name: str, value: torch.Tensor) -> None:
        if self._left == 0:
            self._next_file()
        assert self._writer is not None
        self._writer.write(name, value)
        self._left -= 1

    def _next_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._file += 1
        entries = self.files[self._file]
        self._writer = TensorFileWriter(self.tmp / self.names[self._file], entries, {"format": "pt"})
        self._left = len(entries)

    def commit(self) -> Path:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        weight_map = {e.name: f for f, entries in zip(self.names, self.files) for e in entries}
        if len(self.names) > 1:
            total = sum(e.nbytes for entries in self.files for e in entries)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _meta(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _entries(tensors: dict[str, torch.Tensor]) -> list[Entry]:
    """The files' entries for one model tensor, in the folder's layout (``saved_tensors`` on meta)."""
    return [Entry(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def _write(writer: FolderWriter, tensors: dict[str, torch.Tensor]) -> None:
    for name, value in tensors.items():
        writer.write(name, value.contiguous())


def _write_all(writer: FolderWriter, produce: Callable[[FolderWriter], None]) -> Path:
    try:
        produce(writer)
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def _hf_config(model_config: Any, where: str) -> tuple[dict[str, Any], str | None]:
    if not isinstance(model_config, dict) or "hf_config" not in model_config:
        raise PretrainedError(f"{where} is not a Hugging Face model (no hf_config in its model record); "
                              "export it with `zeroshard ckpt export` without --hf")
    return model_config["hf_config"], model_config.get("source") or None


def export_checkpoint(src: str | Path, out: str | Path, *, max_shard_size: int | str = "5GB",
                      dtype: torch.dtype | None = None, overwrite: bool = False, adapter: bool = False) -> Path:
    """A zeroshard checkpoint of an hf model -> a ``from_pretrained`` folder (offline, one param in memory).
    A LoRA run's checkpoint is written merged (each adapter folded into its base weight, the base
    model's names); ``adapter=True`` writes its adapter folder instead (zeroshard/checkpoint/hf/adapter.py)."""
    from zeroshard.checkpoint import format as fmt
    from zeroshard.checkpoint.load import PieceReader
    from zeroshard.checkpoint.tensorfile import parse_dtype
    from zeroshard.checkpoint.verify import resolve, verify

    directory = resolve(src)
    manifest = verify(directory)
    # The manifest stores the config in its own JSON encoding (int keys of id2label, tuples).
    config, source = _hf_config(fmt.from_json((manifest.get("model") or {}).get("config")), str(directory))
    record = (manifest.get("model") or {}).get("adapter")
    if adapter and record is None:
        raise PretrainedError(f"{directory} holds no adapter (the run trained without --lora-r); export it with --hf")
    params = manifest["params"]
    by_name = {p["fqn"]: p for p in params}
    saved = {p["fqn"]: parse_dtype(p["dtype"], str(directory)) for p in params}
    reader = PieceReader(directory, manifest)

    def read(fqn: str) -> torch.Tensor:
        value = torch.empty(tuple(by_name[fqn]["shape"]), dtype=saved[fqn])
        reader.fill(by_name[fqn], "master", 0, value.view(-1))
        return value

    try:
        if record is not None and adapter:
            tensors = {k: v.to(dtype or v.dtype) for k, v in adapter_tensors(list(by_name), read).items()}
            return write_adapter_folder(out, record, tensors, source, overwrite)
        named = [(p, base_name(p["fqn"]) if record else p["fqn"]) for p in params]
        kept: list[tuple[dict, str]] = [(p, name) for p, name in named if name is not None]
        as_saved = saved_tensors_of_config(config)
        entries = [e for p, name in kept for e in _entries(as_saved(name, _meta(p["shape"], dtype or saved[p["fqn"]])))]
        entries += [e for b in manifest["buffers"]
                    for e in _entries(as_saved(b["name"], _meta(b["shape"], parse_dtype(b["dtype"], str(directory)))))]

        def produce(writer: FolderWriter) -> None:
            for param, name in kept:
                value = read(param["fqn"])
                if record:
                    value = merged_value(param["fqn"], value, record, read)
                _write(writer, as_saved(name, value.to(dtype or value.dtype)))
            for b in manifest["buffers"]:
                _write(writer, as_saved(b["name"], reader.file(b["file"]).read(b["key"])))

        return _write_all(FolderWriter(out, config, source, entries, parse_size(max_shard_size), overwrite), produce)
    finally:
        reader.close()


def export_pretrained(model: nn.Module, out: str | Path, *, max_shard_size: int | str = "5GB",
                      dtype: torch.dtype | None = None, overwrite: bool = False) -> Path | None:
    """A live sharded hf model -> a ``from_pretrained`` folder written by rank 0. A collective:
    every rank gathers one flat group at a time; returns the folder on rank 0, None elsewhere."""
    from zeroshard.comm import collectives
    from zeroshard.comm.names import Phase
    from zeroshard.runtime.expert_placement import all_experts, expert_rows
    from zeroshard.runtime import get_engine
    from zeroshard.runtime.state import gathered_master

    engine = get_engine(model)
    rank, mesh = engine.mesh.rank, engine.mesh
    config, source = _hf_config(getattr(getattr(model, "cfg", None), "to_dict", dict)(), "this model")
    persistent = set(model.state_dict(keep_vars=True))  # non-persistent buffers (inv_freq) are derived
    buffers = [(n, b) for n, b in model.named_buffers() if n in persistent]
    # An expert param (expert parallelism) is written whole: every ep rank's block of it.
    entries = [e for group in engine.groups for slot, ref in zip(group.layout.slots, group.refs)
               for e in _entries(saved_tensors(model, ref.fqn, _meta(expert_rows(group.mesh, slot.shape)[0],
                                                                     dtype or group.master_dtype)))]
    entries += [e for n, b in buffers for e in _entries(saved_tensors(model, n, _meta(b.shape, b.dtype)))]
    problem, result, writer = "", None, None
    try:
        if rank == 0:
            writer = FolderWriter(out, config, source, entries, parse_size(max_shard_size), overwrite)
    except PretrainedError as e:
        problem = str(e)
    problem = next((p for p in collectives.all_gather_object(problem, phase=Phase.EXPORT, mesh=mesh) if p), "")
    if problem:
        raise PretrainedError(problem)
    for group in engine.groups:
        whole = gathered_master(group, Phase.EXPORT)  # every rank takes part, even after rank 0 failed, so none hangs
        # Likewise the gather of an expert param's blocks over ep (a dense param comes back as it is).
        values = [all_experts(whole[slot.offset:slot.end].view(slot.shape), group.mesh, unit=group.unit)
                  for slot in group.layout.slots]
        if writer is None:
            continue
        try:
            for value, ref in zip(values, group.refs):
                _write(writer, saved_tensors(model, ref.fqn, value.to(dtype or whole.dtype)))
        except Exception as e:
            writer.abort()
            writer, problem = None, f"{out}: export failed, nothing written: {e}"
    if writer is not None:
        try:
            for n, b in buffers:
                _write(writer, saved_tensors(model, n, b.detach()))
            result = writer.commit()
        except Exception as e:
            writer.abort()
            problem = f"{out}: export failed, nothing written: {e}"
    problem = next((p for p in collectives.all_gather_object(problem, phase=Phase.EXPORT, mesh=mesh) if p), "")
    if problem:
        raise PretrainedError(problem)
    return result
