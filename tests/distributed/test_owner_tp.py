"""Per-tensor owners under tensor parallelism (zeroshard/runtime/owners.py): a tp-split matrix is
whole only across its tp ranks, so each tp rank's owner joins it over "tp", steps Muon on the whole
matrix and keeps its part. At tp 2 x shard 2 the run equals one process within fp32 rounding."""

from __future__ import annotations

import owner_tp_workloads as otw
import pytest
import torch

from zeroshard.models import GPTConfig
from zeroshard.trainer.launch import spawn


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(otw.suite, 4, args=(str(tmp_path_factory.mktemp("owner_tp")),), timeout_s=600)


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_with_tp_matches_one_process(ranks, stage):
    ref = ranks[0]["ref"]
    got = ranks[0][stage]["params"]
    worst = max((got[k].float() - ref[k].float()).abs().max().item() for k in ref)
    assert worst <= 1e-5, worst
    for r in ranks[1:]:  # every rank gathers the same full state
        assert all(torch.equal(r[stage]["params"][k], got[k]) for k in got)


def test_split_matrices_are_joined_over_tp(ranks):
    # Each block's qkv, attention projection, fc and MLP projection are split; each has one owner
    # per tp rank, which joins value and grad over tp every step: the ledger records them under tp.
    layers = GPTConfig.named("tiny").n_layer
    assert all(r[3]["tp_split"] == 4 * layers for r in ranks)
    assert sum(r[3]["tp_split_mine"] for r in ranks) == 2 * 4 * layers
    assert all(r[3]["tp_gathers"] == 2 * otw.STEPS * r[3]["tp_split_mine"] for r in ranks)


def test_a_checkpoint_of_split_owner_state_resumes_exactly(ranks):
    got = ranks[0]["ckpt"]
    assert all(torch.equal(got["continuous"][k], got["resumed"][k]) for k in got["continuous"])
