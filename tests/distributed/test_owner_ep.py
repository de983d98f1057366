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


def test_muon_on_stacked_experts_steps_each_expert_matrix_as_one_process():
    # Muon on the expert matrices too: each expert's (out, in) matrix of the stacked (E, out, in)
    # param is its own unit on the owner, inside the expert-data-parallel group; one process steps
    # each expert matrix with torch's Muon as a separate param.
    ranks = spawn(oew.worker_experts, 4, args=(3,), timeout_s=600)
    ref = oew.reference_experts()
    got = ranks[0]
    worst = max((got["params"][k] - ref["params"][k].float()).abs().max().item() for k in ref["params"])
    loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    print(f"tiny-moe ep 2 x shard 2 stage 3, Muon on stacked experts: max|param - single| {worst:.3e}, "
          f"max|loss - single| {loss:.3e}")
    assert worst <= 1e-5, worst
    assert loss <= 1e-6
    # The experts really took Muon: with AdamW on them (the plain recipe) they end elsewhere.
    adamw = oew.reference()["params"]
    assert max((ref["params"][k] - adamw[k]).abs().max().item() for k in ref["params"] if "experts" in k) > 1e-4
