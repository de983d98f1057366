"""``zs.load``: restore a checkpoint into a model at any world size and stage, or into a plain model.

Every rank asks for the element ranges it owns now (its shard of each flat group, or the whole
buffer at stage 0) and reads them from whichever saved pieces overlap, possibly from several rank
files. Nothing is gathered and no rank reads what it does not keep, so a 4-rank stage-3
checkpoint loads on 2 ranks at stage 2, on 1 rank, or into an unsharded ``nn.Module`` for eval.

Loading is two-phase so that a bad checkpoint cannot leave a half-loaded model: first every rank
plans its reads, checks the model against the manifest and verifies the checksums of the files
it will read (all ranks then agree on success, so none is left waiting in a collective); only then
are values read into place and published to the compute params.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint import rng as rng_state
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.pieces import SegmentIndex, owned_slots, persistent_buffers, saved_extent
from zeroshard.checkpoint.stages import has_engine, parts_of
from zeroshard.checkpoint.tensorfile import TensorFile, dtype_name
from zeroshard.checkpoint.verify import resolve, verify
from zeroshard.comm import collectives
from zeroshard.runtime import tp
from zeroshard.runtime.optim import user_class
from zeroshard.checkpoint import owner_state

if TYPE_CHECKING:
    from zeroshard.parallel.pipeline import Pipeline


@dataclasses.dataclass
class Loaded:
    """What ``zs.load`` restored."""

    path: Path
    step: int | None
    extra: Any
    saved_world: int
    saved_stage: int
    files_read: list[str]
    lineage: str | None = None
    """The run lineage that wrote it (rotation deletes only its own lineage's checkpoints)."""
    manifest: dict | None = None


class PieceReader:
    """Reads any element range of a saved param from the pieces that overlap it."""

    def __init__(self, directory: Path, manifest: dict) -> None:
        self.directory = directory
        self.manifest = manifest
        self.by_name: dict[str, dict] = {}
        for param in manifest["params"]:
            for alias in param["aliases"] or [param["fqn"]]:
                self.by_name[alias] = param
            self.by_name[param["fqn"]] = param
        self._starts = {p["fqn"]: [piece["start"] for piece in p["pieces"]] for p in manifest["params"]}
        self._open: dict[str, TensorFile] = {}
        # Tensor-parallel params are saved as one part per tp rank; by every name of the whole param.
        self.parts: dict[str, list[dict]] = {}
        for param in manifest["params"]:
            if "tp" in param:
                for name in {param["tp"]["of"], *param["tp"]["aliases"]}:
                    self.parts.setdefault(name, []).append(param)
        for parts in self.parts.values():
            parts.sort(key=lambda p: p["tp"]["rank"])
        self._views: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()

    def pieces(self, param: dict, start: int, stop: int) -> list[dict]:
        starts = self._starts[param["fqn"]]
        first = max(0, bisect.bisect_right(starts, start) - 1)
        return [p for p in param["pieces"][first:] if p["start"] < stop and p["stop"] > start]

    def files(self, param: dict, start: int, stop: int) -> set[str]:
        if "view" in param:
            return {p["file"] for source in param["sources"] for p in source["pieces"]}
        return {p["file"] for p in self.pieces(param, start, stop)}

    def _whole(self, param: dict, kind: str) -> torch.Tensor:
        """All of one saved param's ``kind``, in its saved shape."""
        stored = self.file(param["pieces"][0]["file"]).stored(fmt.piece_key(
            kind, param["fqn"], param["pieces"][0]["start"], param["pieces"][0]["stop"])).dtype
        out = torch.empty(param["shape"], dtype=stored)
        self.fill(param, kind, 0, out.view(-1))
        return out

    def _view_values(self, view: dict, kind: str) -> torch.Tensor:
        """A view's ``kind`` as this rank holds it now: the saved parts joined into the full tensor,
        then cut to the target's tp part. Kept for a few params, as a param is read in several pieces."""
        key = (view["fqn"], kind, view["tp_rank"], json.dumps(view["target"]))
        if key not in self._views:
            sources = [self._whole(p, kind) for p in view["sources"]]
            full = sources[0] if "tp" not in view["sources"][0] else tp.canonical(sources, view["sources"][0]["tp"])
            local = tp.to_local(full, view["target"], view["tp_rank"]) if view["target"] else full
            self._views[key] = local.contiguous().view(-1)
            while len(self._views) > 4:
                self._views.popitem(last=False)
        return self._views[key]

    def file(self, name: str) -> TensorFile:
        if name not in self._open:
            path = fmt.safe_member(self.directory, name, "a piece")
            self._open[name] = TensorFile(path, str(path))
        return self._open[name]

    def fill(self, param: dict, kind: str, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D) with elements ``[start, start + out.numel())`` of ``param``'s ``kind``."""
        if "view" in param:
            out.copy_(self._view_values(param, kind)[start:start + out.numel()])
            return
        stop = start + out.numel()
        covered = start
        for piece in self.pieces(param, start, stop):
            a, b = max(start, piece["start"]), min(stop, piece["stop"])
            key = fmt.piece_key(kind, param["fqn"], piece["start"], piece["stop"])
            self.file(piece["file"]).read_into(key, a - piece["start"], out[a - start:b - start])
            covered = max(covered, b)
        if covered != stop:
            raise CheckpointError(f"{self.directory / fmt.MANIFEST}: no saved data for elements [{covered}, {stop}) "
                                  f"of param {param['fqn']!r}")

    def close(self) -> None:
        self._views.clear()
        for opened in self._open.values():
            opened.close()
        self._open.clear()


@dataclasses.dataclass
class _Read:
    param: dict
    kind: str
    start: int
    out: torch.Tensor


class Plan:
    """Every read a rank will do, checked against the manifest before anything is modified."""

    def __init__(self, directory: Path, manifest: dict) -> None:
        self.directory = directory
        self.manifest = manifest
        self.reader = PieceReader(directory, manifest)
        self.reads: list[_Read] = []
        self.files: set[str] = set()
        self.new_state: dict[nn.Parameter, dict[str, Any]] = {}
        self.owner_reads: dict[int, owner_state.OwnerReads] = {}  # id(optimizer) -> its owned params' reads
        self.saved_groups: list[dict] = []
        self.options: list[dict] = []
        self.where = directory / fmt.MANIFEST

    def read(self, param: dict, kind: str, start: int, out: torch.Tensor) -> None:
        if out.numel():
            self.reads.append(_Read(param, kind, start, out))
            self.files |= self.reader.files(param, start, start + out.numel())

    def lookup(self, names: list[str], shape: torch.Size, dtype: torch.dtype) -> dict:
        param = next((self.reader.by_name[n] for n in names if n in self.reader.by_name), None)
        if param is None:
            raise CheckpointError(f"{self.where} has no param {names[0]!r}: the checkpoint was saved from a "
                                  "different model (check the model config)")
        if list(shape) != param["shape"]:
            raise CheckpointError(f"param {names[0]!r} has shape {list(shape)} in the model but {param['shape']} in "
                                  f"{self.where}; the checkpoint was saved from a different model config")
        if dtype_name(dtype) != param["dtype"]:
            raise CheckpointError(f"param {names[0]!r} is {dtype_name(dtype)} in the model but {param['dtype']} in "
                                  f"{self.where}; build the model in the saved dtype")
        return param

    def resolve(self, names: list[str], shape: torch.Size, dtype: torch.dtype, spec=None, tp_rank: int = 0) -> dict:
        """The saved param to read for a model param (``spec``: its tensor-parallel layout, if any).

        When the saved and the current tensor-parallel layouts differ, a *view* joins the saved
        parts (or the whole param) into the full tensor and cuts this rank's part from it, so any
        (dp, tp) layout loads any other.
        """
        parts = next((self.reader.parts[n] for n in names if n in self.reader.parts), None)
        target = spec.describe() if spec is not None and spec.shard_dim is not None else None
        if parts is None and target is None:
            return self.lookup(names, shape, dtype)
        full_shape = list(spec.shape) if target is not None else list(shape)
        if parts is None:
            sources = [self.lookup(names, torch.Size(full_shape), dtype)]
        else:
            sources = parts
            saved = parts[0]["tp"]
            if saved["full_shape"] != full_shape:
                raise CheckpointError(f"param {names[0]!r} has shape {full_shape} in the model but "
                                      f"{saved['full_shape']} in {self.where}; the checkpoint was saved from a "
                                      "different model config")
            if len(parts) != saved["tp"]:
                raise CheckpointError(f"{self.where} has {len(parts)} of the {saved['tp']} tp parts of {names[0]!r}")
            if target is not None and saved["dim"] == target["dim"] and saved["chunks"] == target["chunks"] and \
                    saved["tp"] == target["tp"]:
                return self.lookup([parts[tp_rank]["fqn"]], shape, dtype)  # the same layout: read the part as saved
        return {"view": True, "fqn": names[0], "sources": sources, "target": target, "tp_rank": tp_rank,
                "state": sources[0]["state"], "param_group": sources[0]["param_group"],
                "used": [p["fqn"] for p in sources]}

    def check_all_used(self, used: set[str]) -> None:
        unused = [p["fqn"] for p in self.manifest["params"] if p["fqn"] not in used]
        if unused:
            raise CheckpointError(f"{self.where} holds params the model does not have: {unused[:5]}"
                                  f"{' ...' if len(unused) > 5 else ''}; the checkpoint is from a different model")

    # -- sharded model -------------------------------------------------------------------------
    def engine(self, engine, *, check_unused: bool = True) -> None:
        """Plan the reads of ``engine``'s shard. ``check_unused``: the engine holds the whole model,
        so a saved param it does not use is an error (a pipeline stage's does not: ``check_names``)."""
        used = set()
        for group in engine.groups:
            for i, slot, a, b in owned_slots(group.layout, group.lo, group.hi):
                param = self._param_of(group, i)
                self.read(param, "master", a - slot.offset + saved_extent(group, i)[1],
                          group.shard[a - group.lo:b - group.lo])
            for i in range(len(group.layout.slots)):
                param = self._param_of(group, i)
                used.update(param.get("used", [param["fqn"]]))
        if engine.mesh.tp_size > 1:  # other tp ranks read the other parts
            used.update(p["fqn"] for parts in self.reader.parts.values() for p in parts)
        if check_unused:
            self.check_all_used(used)

    def check_names(self, names: frozenset[str]) -> None:
        """Every saved param and buffer is one of ``names`` (the whole model's, for a pipeline rank,
        which holds only its stages' and so cannot tell from its own reads)."""
        unused = [p["fqn"] for p in self.manifest["params"]
                  if not ({p["fqn"], *p["aliases"]} | ({p["tp"]["of"]} if "tp" in p else set())) & names]
        if unused:
            raise CheckpointError(f"{self.where} holds params the model does not have: {unused[:5]}"
                                  f"{' ...' if len(unused) > 5 else ''}; the checkpoint is from a different model")
        buffers = sorted(b["name"] for b in self.manifest["buffers"] if b["name"] not in names)
        if buffers:
            raise CheckpointError(f"{self.where} holds buffers the model does not have: {buffers[:5]}")

    def optimizer(self, optimizer) -> None:
        saved = self.manifest.get("optimizer")
        if saved is None:
            raise CheckpointError(f"{self.where} holds no optimizer state (it was saved with optimizer=None); "
                                  "load without an optimizer")
        base = user_class(optimizer)
        name = f"{base.__module__}.{base.__qualname__}"
        if name != saved["class"]:
            raise CheckpointError(f"{self.where} holds {saved['class']} state but the optimizer is {name}")
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(f"{self.where} has {len(saved['param_groups'])} optimizer param groups, the "
                                  f"optimizer has {len(optimizer.param_groups)}; build it with the same groups")
        self.options = [fmt.from_json(g["options"]) for g in saved["param_groups"]]
        self.saved_groups = saved["param_groups"]
        whole = owner_state.plan_reads(self, optimizer)
        if whole is not None:
            self.owner_reads[id(optimizer)] = whole
        for segment in SegmentIndex(optimizer).all:
            group, lo = segment.group, segment.group.lo
            scalars = saved["param_groups"][segment.index]["scalars"]
            owned = list(owned_slots(group.layout, lo + segment.start, lo + segment.stop))
            names = {n for i, slot, _, _ in owned for n in self._param_of(group, i)["state"]}
            if not names:
                continue  # saved before the first step: no state yet, as in a fresh optimizer
            state: dict[str, Any] = {n: _padding_zeroed(segment.param.detach(), owned, lo + segment.start)
                                     for n in sorted(names)}
            for i, slot, a, b in owned:
                param = self._param_of(group, i)
                if param["param_group"] not in (None, segment.index):
                    raise CheckpointError(f"param {slot.fqn!r} was in optimizer param group {param['param_group']} "
                                          f"when saved and is in group {segment.index} now")
                missing = names - set(param["state"])
                if missing:
                    raise CheckpointError(f"{self.where}: param {param['fqn']!r} has no saved optimizer state "
                                          f"{sorted(missing)} though other params of its group do")
                for n in names:
                    rel = a - lo - segment.start
                    self.read(param, f"optim.{n}", a - slot.offset + saved_extent(group, i)[1],
                              state[n][rel:rel + b - a])
            on_device = self.options[segment.index].get("capturable") or self.options[segment.index].get("fused")
            for n, value in scalars.items():
                value = fmt.from_json(value)
                if isinstance(value, torch.Tensor) and on_device:
                    value = value.to(segment.param.device)  # capturable/fused steps keep `step` on the device
                state[n] = value
            self.new_state[segment.param] = state

    def param_of(self, group, index: int) -> dict:
        """The saved param (manifest entry) slot ``index`` of ``group`` reads from."""
        return self._param_of(group, index)

    def _param_of(self, group, index: int) -> dict:
        return self.resolve(group.refs[index].aliases, saved_extent(group, index)[0], group.master_dtype,
                            group.tp_specs[index], group.mesh.tp_rank)

    # -- plain model ---------------------------------------------------------------------------
    def plain(self, model: nn.Module) -> None:
        used = set()
        aliases_of: dict[int, list[str]] = {}
        for name, value in model.named_parameters(remove_duplicate=False):
            aliases_of.setdefault(id(value), []).append(name)
        for name, value in model.named_parameters():
            aliases = aliases_of[id(value)]
            param = self.resolve(aliases, value.shape, value.dtype)
            used.update(param.get("used", [param["fqn"]]))
            if not value.is_contiguous():
                raise CheckpointError(f"param {name!r} is not contiguous; call .contiguous() on it before loading")
            self.read(param, "master", 0, value.detach().view(-1))
        self.check_all_used(used)

    def buffers(self, model: nn.Module, *, strict: bool = True) -> list[tuple[torch.Tensor, dict]]:
        """(buffer, saved entry) of each persistent buffer of ``model``; ``strict``: ``model`` holds
        every buffer of the model (not only one pipeline stage's), so a saved one it lacks is an error."""
        saved = {b["name"]: b for b in self.manifest["buffers"]}
        out = []
        for name, buffer in persistent_buffers(model):
            entry = saved.pop(name, None)
            if entry is None:
                raise CheckpointError(f"{self.where} has no buffer {name!r}; the checkpoint is from a different model")
            if entry["shape"] != list(buffer.shape):
                raise CheckpointError(f"buffer {name!r} has shape {list(buffer.shape)} in the model but "
                                      f"{entry['shape']} in {self.where}")
            self.files.add(entry["file"])
            out.append((buffer, entry))
        if saved and strict:
            raise CheckpointError(f"{self.where} holds buffers the model does not have: {sorted(saved)[:5]}")
        return out

    def execute(self) -> None:
        with torch.no_grad():
            for r in self.reads:
                self.reader.fill(r.param, r.kind, r.start, r.out)


def _padding_zeroed(like: torch.Tensor, owned: list, base: int) -> torch.Tensor:
    """An uninitialised state tensor whose padding (the elements no param owns) is zero, as it would
    be in a run that never stopped; the param elements are about to be read from the checkpoint.
    Cheaper than zeros_like for the whole shard, which the reads would overwrite anyway."""
    out = torch.empty_like(like)
    position = 0
    for _, _, a, b in owned:
        out[position:a - base].zero_()
        position = b - base
    out[position:].zero_()
    return out


def _side(manifest: dict, where: Path, scheduler, sampler, scaler) -> None:
    for name, obj in (("scheduler", scheduler), ("sampler", sampler), ("scaler", scaler)):
        if obj is None:
            continue
        if manifest.get(name) is None:
            raise CheckpointError(f"{where / fmt.MANIFEST} holds no {name} state; pass {name}=None to load without it")
        obj.load_state_dict(fmt.from_json(manifest[name]))


def saved_rng(reader: PieceReader, rank: int) -> dict:
    """Rank ``rank``'s saved RNG state; a rank the saved world did not have derives one (see rng.py)."""
    ranks = {r["rank"]: r["file"] for r in reader.manifest["ranks"]}
    source = ranks.get(rank, ranks[0])
    meta = reader.file(source).metadata.get(fmt.RANK_META_KEY)
    if meta is None:
        raise CheckpointError(f"checkpoint file {reader.directory / source} has no {fmt.RANK_META_KEY} metadata")
    state = json.loads(meta)["rng"]
    return state if rank in ranks else rng_state.derive(state, rank)


def load(path: str | os.PathLike, model: nn.Module | Pipeline, optimizer=None, *, scheduler=None, sampler=None,
         scaler=None, rng: bool = True) -> Loaded:
    """Load a checkpoint (a checkpoint directory, or a root with a ``latest`` pointer) into ``model``.

    A sharded model loads on every rank (collective); any world size and stage works. An unsharded
    ``nn.Module`` loads the full params with no process group (``optimizer`` must then be None).
    A ``Pipeline`` loads each of the rank's stages (``optimizer``: the list of its per-stage
    optimizers) from any checkpoint of the whole model, saved at any pp (1 included).
    ``rng=True`` restores this rank's torch/numpy/python RNG states.
    """
    parts = parts_of(model, optimizer) if has_engine(model) else None
    engine = parts.engine if parts is not None else None
    rank = engine.mesh.rank if engine is not None else 0
    plan: Plan | None = None
    problem: str | None = None
    buffers: list[tuple[torch.Tensor, dict]] = []
    try:
        directory = resolve(path)
        plan = Plan(directory, fmt.read_manifest(directory))
        buffers = _check_plan(plan, model, optimizer, parts, rank=rank, rng=rng)
        _side(plan.manifest, directory, scheduler, sampler, scaler)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others would hang
        problem = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        problem = f"rank {rank}: {problem}" if engine is not None and engine.mesh.world > 1 else problem
    if engine is not None:
        problems = collectives.all_gather_object(problem, phase="checkpoint")
        problem = next((p for p in problems if p), None)
    if problem:
        if plan is not None:
            plan.reader.close()
        raise CheckpointError(problem)
    assert plan is not None  # no rank had a problem, so every step above ran

    _read(plan, buffers, rank=rank, rng=rng)
    for part in parts.parts if parts is not None else []:
        if part.optimizer is not None:
            _install_optimizer(part.optimizer, plan)
        _publish(part.engine)
    m = plan.manifest
    return Loaded(path=directory, step=m["step"], extra=fmt.from_json(m.get("extra")), saved_world=m["world"],
                  saved_stage=m["stage"], files_read=sorted(plan.files), lineage=m.get("lineage"), manifest=m)


def _check_plan(plan: Plan, model: nn.Module | Pipeline, optimizer, parts, *, rank: int,
                rng: bool) -> list[tuple[torch.Tensor, dict]]:
    """Everything this rank can check before any value is read (so every rank can refuse together):
    the checkpoint covers the model (and optimizer), and the files to read are complete. Returns
    the buffers to read, with their manifest entries."""
    directory = plan.directory
    fmt.check_coverage(plan.manifest, directory)
    if parts is not None:
        whole = parts.state_names  # a pipeline rank: checked against the whole model's names
        buffers: list[tuple[torch.Tensor, dict]] = []
        for part in parts.parts:
            plan.engine(part.engine, check_unused=whole is None)
            if part.optimizer is not None:
                plan.optimizer(part.optimizer)
            buffers += plan.buffers(part.module, strict=whole is None)
        if whole is not None:
            plan.check_names(whole)
    else:
        if optimizer is not None:
            raise CheckpointError("optimizer state can only be loaded into a sharded model's optimizer "
                                  "(zs.shard + zs.optimizer); load the plain model with optimizer=None")
        assert isinstance(model, nn.Module)  # has_engine: a Pipeline always has parts
        plan.plain(model)
        buffers = plan.buffers(model)
    ranks = {r["rank"]: r["file"] for r in plan.manifest["ranks"]}
    if rng:
        plan.files.add(ranks.get(rank, ranks[0]))
    verify(directory, plan.files)
    return buffers


def _read(plan: Plan, buffers: list[tuple[torch.Tensor, dict]], *, rank: int, rng: bool) -> None:
    """Read the checked plan's values into the params, optimizer state and buffers (and this
    rank's RNG states), closing the checkpoint's files whatever happens."""
    try:
        plan.execute()
        with torch.no_grad():
            for buffer, entry in buffers:
                plan.reader.file(entry["file"]).read_into(entry["key"], 0, buffer.view(-1))
        if rng:
            rng_state.restore(saved_rng(plan.reader, rank))
    finally:
        plan.reader.close()


def _install_optimizer(optimizer, plan: Plan) -> None:
    """The loaded options and state into one stage's optimizer (its own segments' state only), and the
    owner ranks' whole-param state gathered from every rank's pieces (collective)."""
    for group, options in zip(optimizer.param_groups, plan.options):
        group.update({k: v for k, v in options.items() if k != "params"})
    mine = {p for g in optimizer.param_groups for p in g["params"]}  # its stage's segments
    for param, state in plan.new_state.items():
        if param in mine:
            optimizer.state[param] = state
    if id(optimizer) in plan.owner_reads:  # collective: every rank's pieces to the owners
        owner_state.gather_owned(optimizer, plan.owner_reads[id(optimizer)], plan.saved_groups)


def _publish(engine) -> None:
    """Make the compute params show the loaded masters (and drop grads from before the load)."""
    if engine.policy.shard_params:
        for unit in engine.units:
            unit.reshard()  # a gathered unit holds stale values; the next use gathers fresh ones
    engine.sync_params()
    engine.zero_grad()
