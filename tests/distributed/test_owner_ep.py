"""Per-tensor owners beside expert parallelism: the Muon recipe on tiny-moe at ep 2 x shard 2
equals one process (fp32 orthogonalisation, so a routing decision sees the same values)."""

from __future__ import annotations

import owner_ep_workloads as oew
import pytest

from zeroshard.trainer.launch import spawn


@pytest.mark.parametrize("stage", [3])
def test_muon_recipe_with_expert_parallel_matches_one_process(stage):
    ranks = spawn(oew.worker, 4, args=(stage,), timeout_s=600)
    ref = oew.reference()
    got = ranks[0]
    worst = max((got["params"][k] - ref["params"][k].float()).abs().max().item() for k in ref["params"])
    assert worst <= 1e-5, worst
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= 1e-6
