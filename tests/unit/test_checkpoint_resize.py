"""Resizing a resume under pipeline parallelism: the pipeline microbatch a rank runs at once is
what stays no larger, and the new run's microbatches must split each micro-step's slice."""

from __future__ import annotations

import pytest

from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.resize import plan_resize


def test_without_pp_the_micro_batch_is_kept():
    r = plan_resize(step=3, batch=8, saved_world=4, saved_accum=1, world=2)
    assert r is not None and (r.to_accum, r.micro_batch) == (2, 2)


@pytest.mark.parametrize("saved_world, saved_mb, world, mb, accum", [
    (4, 1, 1, 4, 1),  # 4 ranks without pp -> one pipeline of 4 stages: 4 microbatches of 2, no accumulation
    (2, 2, 4, 1, 1),  # (pp 2, shard 2) -> (pp 1, shard 4): 2 sequences a rank, as the microbatch was
    (2, 4, 4, 1, 2),  # interleaved (pp 2 x 2 stages, 4 microbatches of 1) -> pp 1: micro-steps of 1
])
def test_under_pp_the_pipeline_microbatch_is_kept(saved_world, saved_mb, world, mb, accum):
    r = plan_resize(step=3, batch=8, saved_world=saved_world, saved_accum=1, world=world,
                    saved_microbatches=saved_mb, microbatches=mb)
    assert r is not None and r.to_accum == accum
    assert r.micro_batch == 8 // (saved_world * saved_mb), "the sequences a rank runs at once stay the same"
    assert r.as_dict()["to_microbatches"] == mb


def test_microbatches_that_cannot_split_a_rank_share_are_one_line():
    with pytest.raises(CheckpointError, match=r"pass --microbatches dividing 8") as e:
        plan_resize(step=3, batch=8, saved_world=4, saved_accum=1, world=1, microbatches=3)
    assert "\n" not in str(e.value)
