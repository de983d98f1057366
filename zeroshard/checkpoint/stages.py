"""What one rank saves and loads: one *part* per sharded module it holds, one per pipeline stage it runs.

Without a pipeline a rank has one part: the ``zs.shard`` model, its engine and its optimizer. Under
pp (``zs.save(path, pipe, pipe_optimizers)``, zeroshard/parallel/pipeline/runtime.py) it has one per stage of
``pipe.modules``, each with its own engine and optimizer. A stage's params keep the unsharded
model's names, so the pieces of every stage land in one manifest that reads like a checkpoint of the
whole model: it loads at any pp (1 included) and exports to full tensors with no rename.

The tied embedding/head (zeroshard/parallel/pipeline/tied.py) is saved once, by its owner on the first
stage, under the owner's name with the copy's name as an alias (as a model that shares the param
lists it): the last stage's copy is bitwise the owner (same grad, same optimizer arithmetic), so
the copy is skipped when saving and read from the owner's entry when loading, with its optimizer
state. The manifest's ``pipeline`` section records the placement: which stage held which params,
on which pp rank, and the tied pairs (``placement``); loading does not need it (names do).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from torch import nn

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.runtime.engine import Engine, find_engine, get_engine


@dataclasses.dataclass(frozen=True)
class Part:
    """One sharded module of this rank, and how its params appear in the checkpoint."""

    module: nn.Module
    engine: Engine
    optimizer: Any
    stage: int | None = None
    """Its pipeline stage (virtual stage index); None without a pipeline."""
    skip: frozenset[str] = frozenset()
    """Params saved by another stage under another name (a tied copy), never by this part."""
    aliases: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Extra names a param of this part has in the whole model (a tied owner: the copy's name)."""


@dataclasses.dataclass(frozen=True)
class Parts:
    """Every part of this rank; ``pipeline`` is the ``Pipeline`` they came from, or None."""

    parts: list[Part]
    pipeline: Any = None

    @property
    def engine(self) -> Engine:
        """The first part's engine: its mesh (rank, world, groups) stands for every part's."""
        return self.parts[0].engine

    @property
    def first(self) -> Part:
        return self.parts[0]

    @property
    def state_names(self) -> frozenset[str] | None:
        """Every param and persistent buffer name of the whole model (None without a pipeline: the
        one part holds them all). A pipeline rank holds only its stages', so a checkpoint's names
        are checked against the whole model's instead."""
        return None if self.pipeline is None else self.pipeline.state_names

    def model_info_source(self) -> nn.Module:
        """The module whose class and ``cfg`` describe the model (the whole model's under pp)."""
        return self.first.module

    def model_class(self) -> str:
        if self.pipeline is not None:
            return self.pipeline.model_class
        cls = type(self.first.module)
        return f"{cls.__module__}.{cls.__qualname__}"


def _optimizers(pipe: Any, optimizer: Any) -> list[Any]:
    """One optimizer per stage of ``pipe`` (``pipe.optimizers(...)`` returns them), or Nones."""
    count = len(pipe.modules)
    if optimizer is None:
        return [None] * count
    if not isinstance(optimizer, Sequence) or len(optimizer) != count:
        raise CheckpointError(f"a pipeline rank holds {count} stage(s), each with its own optimizer: pass the list "
                              "pipe.optimizers(...) returned (one per stage, in pipe.modules order)")
    return list(optimizer)


def parts_of(model: Any, optimizer: Any) -> Parts:
    """This rank's parts of ``model``: a ``zs.shard`` model, or a ``Pipeline`` with its per-stage optimizers."""
    from zeroshard.parallel.pipeline import Pipeline

    if not isinstance(model, Pipeline):
        engine = get_engine(model)
        if engine.mesh.pp_size > 1:  # one stage alone would make a checkpoint of part of the model
            raise CheckpointError("this model is one stage of a pipeline (its mesh has pp > 1); save and load the "
                                  "rank's Pipeline with its optimizers: zs.save(path, pipe, pipe_optimizers)")
        return Parts([Part(model, engine, optimizer)])
    parts = []
    for stage, module, opt in zip(model.stage_indices, model.modules, _optimizers(model, optimizer)):
        skip = frozenset(t.copy_fqn for t in model.tied if t.copy_stage == stage)
        aliases: dict[str, tuple[str, ...]] = {t.owner_fqn: (t.copy_fqn,) for t in model.tied if t.owner_stage == stage}
        parts.append(Part(module, get_engine(module), opt, stage=stage, skip=skip, aliases=aliases))
    return Parts(parts, pipeline=model)


def has_engine(model: Any) -> bool:
    """Whether ``model`` is sharded (a ``zs.shard`` model or a pipeline of them), not a plain module."""
    from zeroshard.parallel.pipeline import Pipeline

    return isinstance(model, Pipeline) or find_engine(model) is not None


def placement(parts: Parts, fragments: list[dict]) -> dict:
    """The manifest's ``pipeline`` section, from every rank's ``fragment`` (rank 0 builds it)."""
    pipe = parts.pipeline
    by_stage = {f["stage"]: f for f in fragments}
    return {
        "pp": pipe.mesh.pp_size, "stages": pipe.num_stages, "schedule": pipe.spec.name,
        "stage_params": [by_stage[s]["names"] for s in range(pipe.num_stages)],
        "pp_rank_of_stage": [s % pipe.mesh.pp_size for s in range(pipe.num_stages)],
        "blocks": [list(b) for b in pipe.split.blocks],
        "tied": [{"param": t.owner_fqn, "copy": t.copy_fqn, "owner_stage": t.owner_stage, "copy_stage": t.copy_stage}
                 for t in pipe.tied],
    }
