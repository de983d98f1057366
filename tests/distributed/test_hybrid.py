"""Hybrid sharding on world 4 = 2 replicas x 2 shards."""

from __future__ import annotations

import pytest

import workloads as w
from zeroshard.trainer.launch import spawn


@pytest.fixture(scope="module")
def hybrid():
    return spawn(w.hybrid_suite, 4, timeout_s=420)[0]


@pytest.fixture(scope="module")
def reference():
    return w.reference_run(10, w.GLOBAL_BATCH)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_matches_stage0_and_single_process(hybrid, reference, stage):
    vs_stage0 = w.max_param_diff(hybrid[stage]["params"], hybrid[0]["params"])
    vs_single = w.max_param_diff(hybrid[stage]["params"], reference["params"])
    print(f"hybrid 2x2 stage {stage}: vs stage 0 {vs_stage0:.2e}, vs single process {vs_single:.2e}")
    assert vs_stage0 <= 1e-5 and vs_single <= 1e-5


def test_hybrid_bytes_per_group_equal_theory(hybrid):
    led = hybrid["ledger"]
    assert led["mesh"]["shard_size"] == 2 and led["mesh"]["replicate_size"] == 2
    by = led["by_key"]
    assert by["all_gather:shard:forward"] == led["padded_bytes"]
    assert by["all_gather:shard:backward"] == led["padded_bytes"] - led["root_bytes"] - led["kept_bytes"]
    assert by["reduce_scatter:shard:backward"] == led["padded_bytes"]
    # Across replicas only each rank's already-reduced shard travels.
    assert by["all_reduce:replicate:backward"] == led["shard_bytes"] == led["padded_bytes"] // 2
    assert set(by) == {"all_gather:shard:forward", "all_gather:shard:backward", "reduce_scatter:shard:backward",
                       "all_reduce:replicate:backward"}
