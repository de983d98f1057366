"""Training semantics on two gloo ranks: accumulation, token normalisation, fp16 loss scaling."""

from __future__ import annotations

import pytest

import semantics_workloads as sw
from zeroshard.trainer.launch import spawn

WORLD = 2
# The module's one spawn runs every case; on a loaded two-core machine it can outlast the default
# per-test timeout, which the first test pays for.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def ranks():
    # One spawn for the module: a gloo world costs seconds per process here.
    return spawn(sw.semantics_suite, WORLD, timeout_s=600)


@pytest.fixture(scope="module")
def accumulation(ranks):
    return ranks[0]["accumulation"]


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("stage,mode", [(0, "sharded"), (1, "sharded"), (2, "sharded"), (2, "unsharded"),
                                        (3, "sharded"), (3, "unsharded")])
def test_accumulating_four_micro_batches_equals_one_big_batch(accumulation, stage, mode):
    diff = _max_diff(accumulation[(stage, mode, 4)]["params"], accumulation[(stage, mode, 1)]["params"])
    print(f"stage {stage} ({mode}): G=4 x b vs G=1 x 4b max param diff {diff:.2e}")
    assert diff <= 1e-6


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_accumulation_keeps_grads_at_one_nth(accumulation, stage):
    run = accumulation[(stage, "sharded", 4)]
    assert run["grad_bytes"], "no micro-step was measured"
    # Between micro-steps only the fp32 grad shard exists: 4 bytes x P/N.
    assert set(run["grad_bytes"]) == {4 * run["shard_numel"]}


@pytest.mark.parametrize("stage", [2, 3])
def test_unsharded_accumulation_holds_full_grads(accumulation, stage):
    run = accumulation[(stage, "unsharded", 4)]
    assert set(run["grad_bytes"]) == {4 * run["padded_numel"]}


@pytest.mark.parametrize("stage", [0, 3])
def test_uneven_masked_tokens_are_normalised_globally(accumulation, stage):
    single = sw.train("ref", 1, masked=True)
    got = accumulation[(stage, "masked", 2)]
    diff = _max_diff(got["params"], single["params"])
    print(f"stage {stage}: masked tokens, G=2 on 2 ranks vs one process: {diff:.2e}")
    assert diff <= 1e-6
    for ours, theirs in zip(got["norms"], single["norms"]):
        assert abs(ours - theirs) <= 1e-6 * theirs


def test_global_grad_norm_matches_single_process(accumulation):
    single = sw.train("ref", 1)
    for key in ((0, "sharded", 1), (2, "sharded", 1), (3, "sharded", 4)):
        for ours, theirs in zip(accumulation[key]["norms"], single["norms"]):
            assert abs(ours - theirs) <= 1e-6 * theirs, key
    assert max(single["norms"]) > 1.0, "clipping must be active for the clipped updates to be compared"


@pytest.fixture(scope="module")
def fp16(ranks):
    return [r["fp16"] for r in ranks]


@pytest.mark.parametrize("stage", [0, 3])
def test_overflow_on_one_rank_skips_the_step_everywhere(fp16, stage):
    ranks = [result[stage] for result in fp16]
    for run in ranks:
        assert run["stepped"] == [True, True, False, True, True, True]
        assert run["skipped"] == 1
        # torch GradScaler's rule: grow x2 after 2 clean steps, halve on overflow.
        assert run["scales"] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0]
        assert run["change_per_step"][2] == 0.0 and all(c > 0 for i, c in enumerate(run["change_per_step"]) if i != 2)
    first, second = ranks
    assert _max_diff(first["params"], second["params"]) == 0.0


def test_stage0_replicas_stay_identical_after_skip(fp16):
    a, b = fp16[0][0]["local_shards"], fp16[1][0]["local_shards"]
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a)


def test_precision_manifest_of_bf16_stage3(ranks):
    manifest = ranks[0]["manifest"]
    print(manifest)
    assert manifest["param_compute_dtype"] == "bfloat16"
    assert manifest["all_gather_dtype"] == "bfloat16"
    assert manifest["reduce_dtype"] == "float32"
    assert manifest["master_dtype"] == "float32"
    assert manifest["optimizer_state_dtypes"] == ["float32"]
    assert manifest["grad_accumulation_dtype"] == "float32"
    assert manifest["stage"] == 3 and manifest["world"] == 2
    assert manifest["units"][-1] == "<root>" and len(manifest["units"]) == 5
