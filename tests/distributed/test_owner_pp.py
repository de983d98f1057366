"""Per-tensor owners inside pipeline stages (each stage's engine places the owners of its own
params among its shard ranks): Muon + AdamW at pp 2 x shard 2 equals one process, and stage 3
equals stage 0 bitwise."""

from __future__ import annotations

import owner_pp_workloads as opw
import pp_workloads as w
import pytest
import torch

from owner_workloads import fp32_newton_schulz
from zeroshard.trainer.launch import spawn
from zeroshard.trainer.train import reference_train


@pytest.fixture(scope="module")
def ranks():
    return spawn(opw.suite, 4, timeout_s=600)


@pytest.fixture(scope="module")
def reference():
    with fp32_newton_schulz():
        return reference_train(w.config("gpt", 0, optimizer="muon", nproc=1, pp=1, steps=4))


def test_muon_in_pipeline_stages_matches_one_process(ranks, reference):
    got = ranks[0][3]
    worst = max((got["params"][k] - reference["params"][k].float()).abs().max().item() for k in got["params"])
    assert worst <= 1e-5, worst
    assert max(abs(a - b) for a, b in zip(got["losses"], reference["losses"])) <= 1e-6


def test_stage3_is_bitwise_stage0_in_a_pipeline(ranks):
    for k, v in ranks[0][0]["params"].items():
        assert torch.equal(v, ranks[0][3]["params"][k]), k
