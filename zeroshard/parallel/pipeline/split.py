"""Which blocks each pipeline stage holds: an even split by blocks, or an explicit list per stage.

A split is over *virtual* stages: ``pp × stages_per_rank`` of them, stage ``s`` on pp rank
``s % pp`` (the looped placement torch's interleaved schedules expect). Only the blocks are split;
the first stage always keeps the embeddings and the last the final norm, the head and the loss
(zeroshard/parallel/pipeline/layout.py), which is where the params outside the blocks must run.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """Block indices per virtual stage, in order; every block exactly once."""

    blocks: tuple[tuple[int, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.blocks)


def even_split(n_blocks: int, n_stages: int) -> StageSplit:
    """``n_blocks / n_stages`` consecutive blocks per stage; a one-line error unless it divides."""
    if n_stages < 1 or n_blocks % n_stages:
        raise ValueError(f"{n_stages} pipeline stages do not divide the model's {n_blocks} blocks; pick pp (x stages "
                         f"per rank) dividing {n_blocks}, or give an explicit split (Pipeline(split=...): one list "
                         "of block names per stage)")
    per = n_blocks // n_stages
    return StageSplit(tuple(tuple(range(s * per, (s + 1) * per)) for s in range(n_stages)))


def explicit_split(names: Sequence[Sequence[str]], block_names: Sequence[str], n_stages: int) -> StageSplit:
    """Stages from lists of block module names (``[["blocks.0"], ["blocks.1", "blocks.2", "blocks.3"]]``).

    The lists must name every block once, in model order (a stage's blocks all come before the
    next stage's: activations flow one way), and there must be one non-empty list per stage.
    """
    index = {name: i for i, name in enumerate(block_names)}
    if len(names) != n_stages:
        raise ValueError(f"split has {len(names)} stage lists but the pipeline has {n_stages} stages (pp x stages "
                         "per rank); give one list of block names per stage")
    stages: list[tuple[int, ...]] = []
    for s, stage in enumerate(names):
        unknown = [n for n in stage if n not in index]
        if unknown:
            raise ValueError(f"split stage {s} names {unknown[0]!r}, which is not a block; name blocks only "
                             f"({block_names[0]} .. {block_names[-1]}): the first stage always keeps the embeddings "
                             "and the last the final norm and head")
        if not stage:
            raise ValueError(f"split stage {s} is empty; give every stage at least one block")
        stages.append(tuple(index[n] for n in stage))
    flat = [i for stage in stages for i in stage]
    if flat != list(range(len(block_names))):
        raise ValueError(f"split must name each of the {len(block_names)} blocks once, in model order, stage after "
                         f"stage; got {[list(s) for s in names]}")
    return StageSplit(tuple(stages))
