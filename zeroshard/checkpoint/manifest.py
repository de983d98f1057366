"""What a manifest holds, built in two halves so that a lost manifest can be rebuilt.

- The *skeleton* is what rank 0 knows before any file is written: versions, step, world, mesh,
  stage, units, precision, model, the params' names, shapes, dtypes and tensor- and
  expert-parallel placements, the flat groups, the optimizer's class and options, scheduler/sampler/scaler/extra
  state, the run's lineage and, under pp, the stages' placement (gathered from every pp rank:
  zeroshard/checkpoint/save.py). Rank 0's file carries it in its header.
- Each rank's *report* is what that rank wrote: its pieces (param, element range, state kinds,
  optimizer param group), per-group optimizer scalars and, on rank 0, the buffers. Every rank's
  file carries its report in its header.

``assemble(skeleton, reports)`` is the manifest. A save calls it with the reports gathered from
every rank (adding each file's sha256 and size); ``zeroshard ckpt repair`` calls it with the
skeleton and reports read back from the rank files' headers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.pieces import TP_PART, ordered_refs, saved_extent
from zeroshard.checkpoint.tensorfile import dtype_name
from zeroshard.runtime.expert_placement import placement as expert_placement
from zeroshard.runtime.engine import Engine
from zeroshard.runtime.optim import user_class

PLACEMENTS = ("tp", "ep")
"""A param entry's placement records, after its pieces: ``tp`` on each tensor-parallel part, ``ep``
on an expert param (zeroshard/runtime/expert_placement.py's ``placement``)."""
SKELETON_KEY = "zeroshard.skeleton"
"""Rank 0's file: the manifest skeleton (JSON) in its safetensors metadata."""
REPORT_KEY = "zeroshard.report"
"""Every rank file: that rank's report (JSON) in its safetensors metadata."""
CHECKSUMS_KEY = "zeroshard.checksums"
"""Every rank file: the sha256 of each tensor's bytes (JSON), so the file can be checked alone."""


def param_entries(model: nn.Module, engine: Engine, *, skip: frozenset[str] = frozenset(),
                  aliases: dict[str, tuple[str, ...]] | None = None) -> list[dict]:
    """The manifest's entry of every param of ``model``'s engine, in ``named_parameters`` order.
    ``skip``: params another part saves (a tied copy); ``aliases``: extra names a param has in the
    whole model (zeroshard/checkpoint/stages.py)."""
    params = []
    for group, i in ordered_refs(model, engine.groups):
        slot, ref, spec = group.layout.slots[i], group.refs[i], group.tp_specs[i]
        if slot.fqn in skip:
            continue
        names = list(ref.aliases) + [a for a in (aliases or {}).get(slot.fqn, ()) if a not in ref.aliases]
        # A tensor-parallel param: one entry per tp rank's part, each recording the placement.
        parts: list[tuple[str, list[str], dict | None]] = \
            [(slot.fqn, names, None)] if spec is None or spec.shard_dim is None else \
            [(f"{slot.fqn}{TP_PART}{r}", [], dict(spec.describe(), of=slot.fqn, rank=r, aliases=names,
                                                  full_shape=list(spec.shape))) for r in range(spec.mesh.size())]
        # An expert param: saved whole, each ep rank's block of rows as that run of its elements.
        shape, experts = saved_extent(group, i)[0], expert_placement(group.mesh)
        for fqn, part_aliases, placement in parts:
            params.append({
                "fqn": fqn, "aliases": part_aliases, "shape": list(shape),
                "dtype": dtype_name(group.master_dtype), "trainable": group.trainable,
                **({"tp": placement} if placement is not None else {}),
                **({"ep": experts} if experts is not None else {}),
            })
    return params


def group_entries(engine: Engine, *, skip: frozenset[str] = frozenset()) -> list[dict]:
    """The flat groups as the manifest lists them (``ckpt reshard`` lays its rank files out by them)."""
    return [{"unit": g.unit, "trainable": g.trainable, "master_dtype": dtype_name(g.master_dtype),
             "compute_dtype": dtype_name(g.compute_dtype), "params": [s.fqn for s in g.layout.slots if s.fqn not in skip]}
            for g in engine.groups]


def skeleton(model: nn.Module, engine: Engine, optimizer, *, step: int | None, side: dict[str, Any],
             lineage: str | None, layout: dict | None = None, model_class: str | None = None) -> dict:
    """Everything in the manifest that does not come from the ranks' reports (rank 0, before writing).
    ``layout`` (``params``, ``groups``, ``units`` and ``pipeline``) replaces what ``model``'s engine
    alone gives: a pipeline's stages, gathered from every pp rank (zeroshard/checkpoint/save.py)."""
    from zeroshard import __version__

    if layout is None:
        layout = {"params": param_entries(model, engine), "groups": group_entries(engine),
                  "units": [u.name for u in engine.units]}
    return {
        "format": fmt.FORMAT, "version": fmt.VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "zeroshard": __version__, "torch": torch.__version__, "git": fmt.git_revision(),
        "step": step, "world": engine.mesh.world, "mesh": engine.mesh.describe(),
        "stage": engine.policy.stage, "units": layout["units"],
        "precision": _precision(model, optimizer),
        "model": _model_info(model, model_class),
        "params": layout["params"],
        "groups": layout["groups"],
        **({"pipeline": layout["pipeline"]} if "pipeline" in layout else {}),
        "optimizer": None if optimizer is None else {
            "class": f"{user_class(optimizer).__module__}.{user_class(optimizer).__qualname__}",
            "options": [fmt.to_json({k: v for k, v in g.items() if k != "params"}, f"param group {i}")
                        for i, g in enumerate(optimizer.param_groups)]},
        **side,
        "lineage": lineage,
    }


def assemble(skeleton: dict, reports: list[dict]) -> dict:
    """The manifest: the skeleton with every rank's pieces, scalars, buffers and files merged in.
    Each report needs ``sha256`` and ``bytes`` of its file besides what its header carries."""
    pieces: dict[str, list[dict]] = {}
    kinds: dict[str, set] = {}
    index_of: dict[str, int | None] = {}
    for report in reports:
        for fqn, start, stop, state, index in report["pieces"]:
            pieces.setdefault(fqn, []).append({"file": report["file"], "start": start, "stop": stop})
            kinds.setdefault(fqn, set()).add(tuple(state))
            index_of[fqn] = index
    params = []
    for param in skeleton["params"]:
        fqn = param["fqn"]
        states = kinds.get(fqn, {()})
        if len(states) != 1:
            raise CheckpointError(f"ranks saved different optimizer state for param {fqn!r}: {sorted(states)}")
        entry = {k: v for k, v in param.items() if k not in PLACEMENTS}
        entry.update(param_group=index_of.get(fqn), state=list(next(iter(states))),
                     pieces=sorted(pieces.get(fqn, []), key=lambda p: p["start"]))
        entry.update({k: param[k] for k in PLACEMENTS if k in param})
        params.append(entry)
    manifest = {
        **{k: v for k, v in skeleton.items() if k not in ("params", "optimizer")},
        "params": params,
        "buffers": _buffers(reports),
        "optimizer": _optimizer_info(skeleton["optimizer"], reports),
        "ranks": [{"rank": r["rank"], "file": r["file"]} for r in reports],
        "files": {r["file"]: {"sha256": r["sha256"], "bytes": r["bytes"]} for r in reports},
    }
    fmt.check_coverage(manifest, Path("<being assembled>"))
    return manifest


def _buffers(reports: list[dict]) -> list[dict]:
    """Each persistent buffer once, from the lowest rank that wrote it: rank 0 without a pipeline,
    the first rank of each stage under pp (a stage's buffers live only there)."""
    out, seen = [], set()
    for report in sorted(reports, key=lambda r: r["rank"]):
        for b in report["buffers"]:
            if b["name"] not in seen:
                seen.add(b["name"])
                out.append(dict(b, file=report["file"], key=fmt.buffer_key(b["name"])))
    return out


def _precision(model: nn.Module, optimizer) -> dict | None:
    from zeroshard import runtime as sharding
    describe = getattr(sharding, "precision_manifest", None)
    return None if describe is None else fmt.to_json(describe(model, optimizer), "precision manifest")


def _model_info(model: nn.Module, model_class: str | None = None) -> dict:
    cfg = getattr(model, "cfg", None)
    config = cfg.to_dict() if cfg is not None and hasattr(cfg, "to_dict") else None
    from zeroshard.checkpoint.hf.adapter import adapter_record

    adapter = adapter_record(model)  # a LoRA run's LoraConfig, for the merged or adapter export
    return {"class": model_class or f"{type(model).__module__}.{type(model).__qualname__}",
            "config": fmt.to_json(config, "model.cfg.to_dict()"), **({"adapter": adapter} if adapter else {})}


def _optimizer_info(optimizer: dict | None, reports: list[dict]) -> dict | None:
    if optimizer is None:
        return None
    scalars: dict[int, dict[str, Any]] = {}
    for report in reports:
        for key, values in report["scalars"].items():
            _merge_scalars_json(scalars.setdefault(int(key), {}), values, int(key))
    return {"class": optimizer["class"],
            "param_groups": [{"options": options, "scalars": scalars.get(i, {})}
                             for i, options in enumerate(optimizer["options"])]}


def _merge_scalars_json(into: dict, new: dict, index: int) -> None:
    for name, value in new.items():
        if name in into and into[name] != value:
            raise CheckpointError(f"optimizer scalar state {name!r} of param group {index} differs between ranks "
                                  f"({into[name]} vs {value})")
        into[name] = value
